"""The conversations benchmarks/speculative.py decodes: (a) code editing, (b) a chat quoting earlier
turns, (c) fresh prose, and for each an earlier conversation of the same kind (another user's, put
into the store before the measured one, for store drafts). The earlier assistant turns are written
here, so every run decodes the same prompts."""

from __future__ import annotations

CODE = '''\
"""A small inventory of items with prices and quantities."""

from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0

    def value(self) -> float:
        return self.price * self.quantity


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add(self, name: str, price: float, quantity: int = 1) -> Item:
        item = self.items.get(name)
        if item is None:
            item = self.items[name] = Item(name, price, 0)
        item.quantity += quantity
        return item

    def remove(self, name: str, quantity: int = 1) -> None:
        item = self.items[name]
        if quantity > item.quantity:
            raise ValueError(f"only {item.quantity} of {name} left")
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[name]

    def total(self) -> float:
        return sum(item.value() for item in self.items.values())

    def cheapest(self) -> Item | None:
        return min(self.items.values(), key=lambda item: item.price, default=None)

    def report(self) -> str:
        lines = [f"{item.name}: {item.quantity} x {item.price:.2f}" for item in self.items.values()]
        lines.append(f"total: {self.total():.2f}")
        return "\\n".join(lines)
'''

LANDLORD = (
    "Dear Mr. Harris,\n\nI am writing to let you know that the heating in my flat has not been working since "
    "Monday. The radiators in the living room and the bedroom stay cold even when the boiler is on, and the "
    "temperature inside has dropped below fifteen degrees at night. The hot water still works, so I think the "
    "problem is the pump or the thermostat in the hall. Could you please arrange for an engineer to look at it "
    "this week? I am at home every afternoon and can let them in, and I can send photos of the boiler's display "
    "if that helps.\n\nThank you for your help.\n\nKind regards,\nAnna"
)
NEIGHBOUR = (
    "Hi Sam,\n\nJust a friendly reminder that the bins go out on Tuesday evening this week, because of the bank "
    "holiday on Monday. The green bin is for garden waste and the blue one for paper and cans.\n\nThanks!"
)

WORKLOADS = {
    "a code editing": [
        {"role": "user", "content": "Here is a Python file:\n\n```python\n" + CODE + "```\n\n"
         "Rename the method `value` to `worth` everywhere. Reply with the whole updated file."},
    ],
    "b chat quoting earlier turns": [
        {"role": "user", "content": "Write a short reminder to my neighbour Sam that the bins go out on Tuesday."},
        {"role": "assistant", "content": NEIGHBOUR},
        {"role": "user", "content": "Thanks. Now a short note to my landlord about the broken heating in my flat."},
        {"role": "assistant", "content": LANDLORD},
        {"role": "user", "content": "Copy the note again, exactly as you wrote it."},
    ],
    "c fresh prose": [
        {"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."},
    ],
}

EARLIER = {  # another user's conversation of the same kind, in the store before the measured one
    "a code editing": [
        {"role": "user", "content": "Here is a Python file:\n\n```python\n" + CODE + "```\n\n"
         "Add a docstring to the method `total`. Reply with the whole updated file."},
    ],
    "b chat quoting earlier turns": [
        {"role": "user", "content": "Write a short note to my landlord about the broken heating in my flat."},
        {"role": "assistant", "content": LANDLORD},
        {"role": "user", "content": "Make it a little shorter."},
    ],
    "c fresh prose": [
        {"role": "user", "content": "Write a short story about a fisherman who finds a key on the beach."},
    ],
}

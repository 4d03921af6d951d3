// A small, safe Markdown renderer: text in, DOM nodes out.
// Contract: renderMarkdown(text) returns a DocumentFragment built only with createElement,
// createTextNode, textContent and setAttribute, from a fixed list of tags; HTML in the text stays
// text; a link is made only for an http:, https: or mailto: URL. Supported: paragraphs, line
// breaks, # headings, **bold**, *italic*, `code`, ``` fenced code ```, - * 1. lists, > quotes, [t](u).

const TAGS = new Set(["p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "code", "pre",
  "ul", "ol", "li", "blockquote", "a", "span"]);
const MAX_DEPTH = 6;
const FENCE = /^ {0,3}(`{3,})\s*([^`]*)$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const LINK = /^\[([^\[\]]*)\]\(\s*([^()\s]*)\s*\)/;

function el(tag) {
  if (!TAGS.has(tag)) throw new Error("tag not allowed: " + tag);
  return document.createElement(tag);
}

function text(parent, value) {
  if (value) parent.appendChild(document.createTextNode(value));
}

/** The URL as a safe href, or null (only http:, https: and mailto:). */
export function safeHref(url) {
  let parsed;
  try {
    parsed = new URL(url);
  } catch {
    return null;
  }
  return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
}

function inline(parent, src, depth) {
  if (depth > MAX_DEPTH) return text(parent, src);
  let plain = "";
  let i = 0;
  const flush = () => { text(parent, plain); plain = ""; };
  while (i < src.length) {
    const c = src[i];
    if (c === "`") {
      const end = src.indexOf("`", i + 1);
      if (end > i + 1) {
        flush();
        const code = el("code");
        code.textContent = src.slice(i + 1, end);
        parent.appendChild(code);
        i = end + 1;
        continue;
      }
    } else if (c === "*" && src[i + 1] === "*") {
      const end = src.indexOf("**", i + 2);
      if (end > i + 2) {
        flush();
        const strong = el("strong");
        inline(strong, src.slice(i + 2, end), depth + 1);
        parent.appendChild(strong);
        i = end + 2;
        continue;
      }
    } else if (c === "*" && src[i + 1] !== " ") {
      const end = src.indexOf("*", i + 1);
      if (end > i + 1 && src[end - 1] !== " ") {
        flush();
        const em = el("em");
        inline(em, src.slice(i + 1, end), depth + 1);
        parent.appendChild(em);
        i = end + 1;
        continue;
      }
    } else if (c === "[") {
      const m = LINK.exec(src.slice(i));
      const href = m && safeHref(m[2]);
      if (href) {
        flush();
        const a = el("a");
        a.setAttribute("href", href);
        a.setAttribute("rel", "noopener noreferrer");
        a.setAttribute("target", "_blank");
        a.textContent = m[1] || href;
        parent.appendChild(a);
        i += m[0].length;
        continue;
      }
    }
    plain += c;
    i += 1;
  }
  flush();
}

function closesFence(row, fence) {
  const t = row.trim();
  return t.startsWith(fence) && /^`+$/.test(t);
}

function lines(parent, rows, depth) {
  rows.forEach((row, k) => {
    if (k) parent.appendChild(el("br"));
    inline(parent, row, depth);
  });
}

function blocks(parent, rows, depth) {
  let i = 0;
  let para = [];
  const endPara = () => {
    if (para.length) {
      const p = el("p");
      lines(p, para, depth);
      parent.appendChild(p);
      para = [];
    }
  };
  while (i < rows.length) {
    const row = rows[i];
    let m;
    if ((m = FENCE.exec(row))) {
      endPara();
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < rows.length && !closesFence(rows[i], fence)) body.push(rows[i++]);
      i += 1; // the closing fence (an unclosed fence runs to the end)
      const pre = el("pre");
      if (m[2].trim()) {
        const label = el("span");
        label.setAttribute("class", "lang");
        label.textContent = m[2].trim();
        pre.appendChild(label);
      }
      const code = el("code");
      code.textContent = body.join("\n");
      pre.appendChild(code);
      parent.appendChild(pre);
    } else if ((m = HEADING.exec(row))) {
      endPara();
      const h = el("h" + m[1].length);
      inline(h, m[2], depth);
      parent.appendChild(h);
      i += 1;
    } else if (depth < MAX_DEPTH && QUOTE.test(row)) {
      endPara();
      const inner = [];
      while (i < rows.length && (m = QUOTE.exec(rows[i]))) { inner.push(m[1]); i += 1; }
      const quote = el("blockquote");
      blocks(quote, inner, depth + 1);
      parent.appendChild(quote);
    } else if ((m = ITEM.exec(row))) {
      endPara();
      const ordered = /\d/.test(m[1][0]);
      const list = el(ordered ? "ol" : "ul");
      while (i < rows.length && (m = ITEM.exec(rows[i])) && /\d/.test(m[1][0]) === ordered) {
        const li = el("li");
        inline(li, m[2], depth);
        list.appendChild(li);
        i += 1;
      }
      parent.appendChild(list);
    } else if (!row.trim()) {
      endPara();
      i += 1;
    } else {
      para.push(row);
      i += 1;
    }
  }
  endPara();
}

/** The Markdown ``source`` as a DocumentFragment (see the contract at the top). */
export function renderMarkdown(source) {
  const fragment = document.createDocumentFragment();
  blocks(fragment, String(source).replace(/\r\n?/g, "\n").split("\n"), 0);
  return fragment;
}

/** The length of the longest prefix of ``source`` that ends with a blank line outside any code
 * fence (0 if none): the blocks before it render the same alone as within any longer text, so a
 * streamed reply renders them once and re-renders only the rest. */
export function finishedLength(source) {
  const rows = String(source).split("\n");
  let fence = null;
  let offset = 0;
  let cut = 0;
  for (let k = 0; k < rows.length - 1; k += 1) { // the last row may still grow
    const row = rows[k];
    offset += row.length + 1;
    if (fence) {
      if (closesFence(row, fence)) fence = null;
    } else {
      const m = FENCE.exec(row);
      if (m) fence = m[1];
      else if (!row.trim()) cut = offset;
    }
  }
  return cut;
}

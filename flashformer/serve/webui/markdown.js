// Model text into the DOM. Every piece of the text becomes a text node (textContent,
// createTextNode) inside elements this file creates: nothing here parses HTML, so markup
// or script in an answer is shown as the characters it is, never run.
//
// The Markdown kept: fenced code blocks (``` or ~~~, an unclosed fence runs to the end,
// as while an answer streams), `inline code`, **bold**, *italic*, # headings, - and 1. lists,
// paragraphs with their line breaks. Links and images stay text.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*)$/;
const ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(\S(?:[\s\S]*?\S)?)\*\*|\*(\S(?:[^*]*?\S)?)\*/g;

/** Fill `element` with `text`: as Markdown, or as plain text (white-space kept by CSS). */
export function render(text, element, markdown) {
  element.replaceChildren();
  element.classList.toggle("plain", !markdown);
  if (!markdown) {
    element.textContent = text;
    return;
  }
  const lines = text.split("\n");
  let paragraph = [];
  let list = null;
  const flush = () => {
    if (paragraph.length) {
      const p = element.appendChild(document.createElement("p"));
      paragraph.forEach((line, i) => {
        if (i) p.appendChild(document.createElement("br"));
        inline(line, p);
      });
    }
    paragraph = [];
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const body = [];
      const close = new RegExp(`^ {0,3}${fence[1][0]}{${fence[1].length},}\\s*$`);
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      const pre = element.appendChild(document.createElement("pre"));
      const code = pre.appendChild(document.createElement("code"));
      if (fence[2]) code.dataset.language = fence[2];
      code.textContent = body.join("\n");
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      flush();
      const level = Math.min(heading[1].length + 2, 6);  // # is a section of an answer, not the page
      inline(heading[2], element.appendChild(document.createElement(`h${level}`)));
      continue;
    }
    const item = line.match(ITEM);
    if (item) {
      const kind = /\d/.test(item[1]) ? "OL" : "UL";
      if (paragraph.length || !list || list.tagName !== kind) {
        flush();
        list = element.appendChild(document.createElement(kind));
      }
      inline(item[2], list.appendChild(document.createElement("li")));
      continue;
    }
    if (!line.trim()) flush();
    else if (list) inline(" " + line.trim(), list.lastChild);  // a list item's continuation
    else paragraph.push(line);
  }
  flush();
}

/** `text`'s inline Markdown (code, bold, italic) appended to `parent` as elements and text nodes. */
function inline(text, parent) {
  let at = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.appendChild(document.createTextNode(text.slice(at, match.index)));
    const [tag, inner] = match[1] ? ["code", match[2]] : match[3] ? ["strong", match[3]] : ["em", match[4]];
    const node = parent.appendChild(document.createElement(tag));
    if (tag === "code") node.textContent = inner;
    else inline(inner, node);
    at = match.index + match[0].length;
  }
  parent.appendChild(document.createTextNode(text.slice(at)));
}

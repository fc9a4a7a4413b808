// Live updates without inline script: every element with data-live is refreshed from that
// same-origin URL (a fragment the server renders and escapes) every two seconds, until the
// fragment says data-final="1" or the page is left. A fragment that carries data-seq (the last
// event it shows) is asked for with ?after=SEQ, and the server answers 204, nothing, while no
// event came since. No library: the page works without it.
"use strict";
(function () {
  const PERIOD_MS = 2000;
  function watch(el) {
    const url = el.getAttribute("data-live");
    let timer = null;
    function target() {
      const marked = el.querySelector("[data-seq]");
      if (!marked) return url;
      const seq = marked.getAttribute("data-seq");
      return url + (url.indexOf("?") < 0 ? "?" : "&") + "after=" + encodeURIComponent(seq);
    }
    async function tick() {
      try {
        const reply = await fetch(target(), { credentials: "same-origin", cache: "no-store" });
        if (reply.status === 204) {
          // nothing new since the events shown
        } else if (reply.ok) {
          const html = await reply.text();
          const doc = new DOMParser().parseFromString(html, "text/html");
          el.replaceChildren(...doc.body.childNodes);
          if (el.querySelector('[data-final="1"]')) return;
        } else if (reply.status === 401 || reply.status === 403 || reply.status === 404) {
          return;
        }
      } catch (err) {
        // the server restarting, say: try again next period
      }
      timer = setTimeout(tick, PERIOD_MS);
    }
    timer = setTimeout(tick, PERIOD_MS);
    window.addEventListener("pagehide", function () { clearTimeout(timer); });
  }
  // A session's exec box: the command's output parts after those shown (data-next) are asked
  // for every half second and added as text (never parsed as HTML), until the command ends.
  const EXEC_MS = 500;
  function follow(el) {
    const url = el.getAttribute("data-exec");
    const out = el.querySelector("#exec-output");
    const status = el.querySelector("#exec-status");
    let next = parseInt(el.getAttribute("data-next") || "0", 10);
    let timer = null;
    async function tick() {
      try {
        const reply = await fetch(url + "?after=" + next, { credentials: "same-origin", cache: "no-store" });
        if (reply.status === 401 || reply.status === 403 || reply.status === 404) return;
        if (reply.ok) {
          const got = await reply.json();
          for (const [stream, text] of got.parts) {
            const span = document.createElement("span");
            span.className = stream === "stderr" ? "stderr" : "stdout";
            span.textContent = text;
            out.appendChild(span);
          }
          next = got.next;
          if (got.done) {
            let words = got.exit || "did not run";
            if (got.error) words += ": " + got.error;
            if (got.truncated) words += " (output past 1 MiB not kept: use fleet session exec)";
            status.textContent = words;
            el.setAttribute("data-done", "1");
            return;
          }
        }
      } catch (err) {
        // the server restarting, say: try again next period
      }
      timer = setTimeout(tick, EXEC_MS);
    }
    if (el.getAttribute("data-done") !== "1") timer = setTimeout(tick, EXEC_MS);
    window.addEventListener("pagehide", function () { clearTimeout(timer); });
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(watch);
    document.querySelectorAll("[data-exec]").forEach(follow);
  });
})();

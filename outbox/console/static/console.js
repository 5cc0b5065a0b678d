// The console's only script: live regions. An element with data-poll="URL" has its
// content replaced by GET URL every data-interval ms (default 5000), while the tab is
// visible. No framework, no build step; pages work without it (reload by hand).
(function () {
  "use strict";
  function live(el) {
    var url = el.getAttribute("data-poll");
    var every = parseInt(el.getAttribute("data-interval") || "5000", 10);
    var busy = false;
    function tick() {
      if (busy || document.hidden) { return; }
      if (el.querySelector("details[open]")) { return; }  // do not close what is being read
      busy = true;
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) {
          if (!r.ok) { throw new Error(String(r.status)); }
          return r.text();
        })
        .then(function (html) { el.innerHTML = html; el.removeAttribute("data-stale"); })
        .catch(function () { el.setAttribute("data-stale", "true"); })
        .then(function () { busy = false; });
    }
    setInterval(tick, every);
    document.addEventListener("visibilitychange", tick);
  }
  document.querySelectorAll("[data-poll]").forEach(live);
})();

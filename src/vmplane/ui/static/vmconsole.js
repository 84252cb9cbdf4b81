/* vmplane: a VM page's tabs and its serial console (issue 31), on the vendored xterm.js and its fit addon.
 *
 * Opening: POST /ui/vms/{name}/console/ticket with the page's CSRF header (the session cookie goes along),
 * then a websocket to the path the ticket names, on this page's own host; its first message is
 * {"ticket": T, "mode": "write" | "read"}: the ticket never goes in a URL. Then the guest's output comes as
 * binary messages (written to the terminal), keys go as binary messages, and the server's notices are JSON
 * text (attached, mode, notice), shown in the status line; a close shows its reason. */
(function () {
  "use strict";

  var section = document.getElementById("vm-console");
  if (!section) return;
  var vm = section.dataset.vm;
  var statusLine = section.querySelector("[data-console-status]");
  var termBox = section.querySelector("[data-console-term]");
  var openButtons = section.querySelectorAll("[data-console-open]");
  var takeButton = section.querySelector("[data-console-take]");
  var closeButton = section.querySelector("[data-console-close]");
  var encoder = new TextEncoder();
  var term = null, fit = null, socket = null;

  // -- the tabs: Details and Console (#console in the address selects the console's) -------------
  var tabs = document.querySelectorAll(".tabs [role=tab]");

  function showTab(name) {
    tabs.forEach(function (tab) {
      var mine = tab.getAttribute("href") === "#" + name;
      tab.setAttribute("aria-selected", mine ? "true" : "false");
      document.getElementById(tab.getAttribute("aria-controls")).hidden = !mine;
    });
    if (name === "console") fitNow();
  }

  tabs.forEach(function (tab) {
    tab.addEventListener("click", function (event) {
      event.preventDefault();
      var name = tab.getAttribute("href").slice(1);
      history.replaceState(null, "", "#" + name); // no new history entry, no scroll
      showTab(name);
    });
  });
  if (location.hash === "#console") showTab("console");

  // -- the status line: connecting / keyboard / read-only / closed: reason -----------------------
  function setState(state, text) {
    section.dataset.console = state; // idle | connecting | write | read | closed
    statusLine.textContent = text;
    var open = state === "write" || state === "read";
    openButtons.forEach(function (b) { b.hidden = open || state === "connecting"; });
    takeButton.hidden = state !== "read";
    closeButton.hidden = !open && state !== "connecting";
    refreshRunning();
  }

  function modeText(mode, detail) {
    return (mode === "write" ? "keyboard" : "read-only") + (detail ? " · " + detail : "");
  }

  // a stopped VM's console can not open: the page's details say so (swapped in live by htmx); an open
  // session waits for the VM to run again (the server opens its console again then)
  function refreshRunning() {
    var state = section.querySelector("[data-console-state]");
    var running = !state || state.dataset.consoleState === "open";
    openButtons.forEach(function (b) { b.disabled = !running; });
    if (!running && socket) statusLine.textContent = modeText(section.dataset.console, state.textContent.trim());
  }
  document.body.addEventListener("htmx:oobAfterSwap", refreshRunning);
  document.body.addEventListener("htmx:afterSettle", refreshRunning);

  // -- the terminal ---------------------------------------------------------------------------------
  function ensureTerminal() {
    if (term) return;
    term = new Terminal({ convertEol: false, cursorBlink: true, scrollback: 5000,
                          fontFamily: "ui-monospace, monospace", fontSize: 14 });
    fit = new FitAddon.FitAddon();
    term.loadAddon(fit);
    term.open(termBox);
    term.onData(function (data) {
      if (socket && socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data));
    });
    new ResizeObserver(fitNow).observe(termBox); // resizes with the window (and the tab shown)
    fitNow();
  }

  function fitNow() {
    // a hidden terminal has no size: fit when it shows
    if (fit && termBox.offsetWidth > 0 && termBox.offsetHeight > 0) fit.fit();
  }

  // -- opening, the notices, closing ------------------------------------------------------------------
  function csrf() {
    try {
      return JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRF-Token"];
    } catch (e) {
      return "";
    }
  }

  function refusal(response) {
    // the console answers its errors as a fragment (<p class="error">) to an htmx-like request
    return response.text().then(function (body) {
      try {
        return JSON.parse(body).message;
      } catch (e) {
        var p = new DOMParser().parseFromString(body, "text/html").querySelector(".error");
        return (p ? p.textContent : body.slice(0, 200)).trim() || "HTTP " + response.status;
      }
    });
  }

  function open(mode) {
    if (socket) return;
    setState("connecting", "connecting…"); // (the terminal's box shows from now on)
    ensureTerminal();
    fetch("/ui/vms/" + encodeURIComponent(vm) + "/console/ticket", {
      method: "POST",
      credentials: "same-origin",
      headers: { "X-CSRF-Token": csrf(), "HX-Request": "true", Accept: "application/json" },
    }).then(function (response) {
      if (!response.ok) return refusal(response).then(function (why) { setState("closed", "closed: " + why); });
      return response.json().then(function (ticket) { connect(ticket, mode); });
    }).catch(function (error) {
      setState("closed", "closed: no ticket (" + error + ")");
    });
  }

  function connect(ticket, mode) {
    // under /ui, where the session cookie (path /ui) goes; the CLI's is the ticket's (/api/v1/vms/{name}/console)
    var path = section.dataset.socket || ticket.websocket;
    var scheme = location.protocol === "https:" ? "wss:" : "ws:";
    var ws = new WebSocket(scheme + "//" + location.host + path);
    ws.binaryType = "arraybuffer";
    socket = ws;
    ws.onopen = function () { ws.send(JSON.stringify({ ticket: ticket.ticket, mode: mode })); };
    ws.onmessage = function (event) {
      if (typeof event.data !== "string") {
        term.write(new Uint8Array(event.data));
        return;
      }
      var notice;
      try { notice = JSON.parse(event.data); } catch (e) { return; }
      if (notice.type === "attached") {
        setState(notice.mode, modeText(notice.mode, notice.host ? "on host " + notice.host : ""));
        if (notice.mode === "write") term.focus();
      } else if (notice.type === "mode") {
        setState(notice.mode, modeText(notice.mode, notice.text));
        if (notice.mode === "write") term.focus();
      } else if (notice.type === "notice") {
        statusLine.textContent = modeText(section.dataset.console, notice.text);
      }
    };
    ws.onclose = function (event) {
      if (socket === ws) socket = null;
      var why = event.reason || (event.code === 1000 ? "closed" : "the connection ended (code " + event.code + ")");
      setState("closed", "closed: " + why);
      term.write("\r\n[vmplane: console closed: " + why + "]\r\n");
    };
  }

  openButtons.forEach(function (button) {
    button.addEventListener("click", function () { open(button.dataset.consoleOpen); });
  });
  takeButton.addEventListener("click", function () {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "take" }));
  });
  closeButton.addEventListener("click", function () {
    if (socket) socket.close(1000, "closed by its viewer");
  });
  setState("idle", "not open");
})();

// The live page: polls live.json every 5 s and redraws the table. No framework, no
// network beyond this dashboard; values are set as text, never as HTML.
(function () {
  "use strict";
  var table = document.getElementById("live");
  if (!table) { return; }
  var source = table.getAttribute("data-source");

  function seconds(v) {
    if (v === null || v === undefined) { return ""; }
    return v < 1 ? (v * 1000).toFixed(0) + " ms" : v < 120 ? v.toFixed(1) + " s" : (v / 60).toFixed(1) + " min";
  }

  function cell(row, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) { td.className = cls; }
    row.appendChild(td);
  }

  function sum(xs) { return xs.reduce(function (a, b) { return a + b; }, 0); }

  function draw(data) {
    var body = document.createElement("tbody");
    data.kinds.forEach(function (k) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-kind", k.kind);
      cell(tr, k.kind);
      ["submitted", "succeeded", "failed"].forEach(function (name) {
        cell(tr, k.spark[name] + " " + sum(k[name]), "spark");
      });
      var last = k.submitted.length - 1;
      cell(tr, k.submitted[last] + " / " + k.succeeded[last] + " / " + k.failed[last], "num");
      [k.wait_p50, k.wait_p95, k.run_p50, k.run_p95].forEach(function (v) { cell(tr, seconds(v), "num"); });
      body.appendChild(tr);
    });
    if (!data.kinds.length) {
      var tr = document.createElement("tr");
      cell(tr, "Nothing submitted or finished in the window.", "muted");
      tr.firstChild.colSpan = 9;
      body.appendChild(tr);
    }
    table.replaceChild(body, table.tBodies[0]);
    document.getElementById("live-now").textContent = "as of " + data.now.replace("T", " ").slice(0, 19) + " UTC";
    document.getElementById("live-capped").hidden = !data.capped;
  }

  function poll() {
    fetch(source, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
        return r.json();
      })
      .then(draw)
      .catch(function () { /* keep the last figures; try again on the next tick */ })
      .then(function () { window.setTimeout(poll, 5000); });
  }
  poll();
})();

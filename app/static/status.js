// Redraws the run page's status section (templates/_status.html) from the status API, so "up" stays true.
(function () {
  const section = document.getElementById("status");
  if (!section) return;
  const url = `/api/v1/runs/${section.dataset.slug}/status`;
  const text = (id, value) => { document.getElementById(id).textContent = String(value); };
  const when = (iso) => iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace(/(Z|\+00:00)$/, " UTC") : "never";

  function show(status) {
    const notice = document.getElementById("status-notice");
    notice.hidden = !status.notice;
    notice.firstElementChild.textContent = status.notice || "";
    const body = document.querySelector("#status-coordinators tbody");
    body.replaceChildren(...status.coordinators.map((c) => {
      const row = document.createElement("tr");
      const cells = [c.peer_id.slice(-12), c.up ? "up" : "down", when(c.last_heartbeat)].map((value) => {
        const cell = document.createElement("td");
        cell.textContent = value;
        return cell;
      });
      cells[1].className = c.up ? "up" : "down";
      row.replaceChildren(...cells);
      return row;
    }));
    for (const key of ["online", "reachable", "unreachable", "client"]) text(`status-${key}`, status.peers[key]);
    // With no coordinator up the counts are the last snapshot's: say from when.
    const stale = status.coordinators_up === 0 && Boolean(status.peers.seen_at);
    document.getElementById("status-as-of").hidden = !stale;
    text("status-seen-at", stale ? when(status.peers.seen_at) : "");
    text("status-version", status.portal_version);
  }

  setInterval(() => fetch(url).then((r) => (r.ok ? r.json() : null)).then((s) => s && show(s)).catch(() => {}), 5000);
})();

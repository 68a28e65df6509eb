// Live dashboard: history from the JSON API, then one server-sent event per coordinator snapshot.
(function () {
  const root = document.getElementById("swarm");
  const slug = root.dataset.slug;
  const maxPoints = 300;
  const fmt = {
    samples_total: (v) => v.toLocaleString("en-US"),
    samples_per_second: (v) => v.toFixed(0),
    loss: (v) => (v === null ? "–" : v.toFixed(3)),
    eta_seconds: (v) => (v === null ? "–" : v.toFixed(0) + " s"),
  };

  function chart(id, label, color) {
    return new Chart(document.getElementById(id), {
      type: "line",
      data: { labels: [], datasets: [{ label, data: [], borderColor: color, pointRadius: 0, tension: 0.2 }] },
      options: { animation: false, responsive: true, plugins: { legend: { display: false } },
                 scales: { x: { ticks: { maxTicksLimit: 6 } } } },
    });
  }
  const charts = {
    samples_per_second: chart("chart-throughput", "samples/s", "#2563eb"),
    loss: chart("chart-loss", "loss", "#dc2626"),
    peers_online: chart("chart-peers", "peers", "#16a34a"),
  };

  function addPoint(swarm) {
    if (!swarm.updated_at) return;
    const label = new Date(swarm.updated_at).toLocaleTimeString();
    for (const [field, c] of Object.entries(charts)) {
      c.data.labels.push(label);
      c.data.datasets[0].data.push(swarm[field]);
      if (c.data.labels.length > maxPoints) { c.data.labels.shift(); c.data.datasets[0].data.shift(); }
    }
  }

  function show(swarm) {
    for (const id of ["peers_online", "samples_per_second", "epoch", "loss", "samples_total", "eta_seconds"]) {
      const el = document.getElementById(id);
      if (el) el.textContent = fmt[id] ? fmt[id](swarm[id]) : swarm[id];
    }
    document.getElementById("updated_at").textContent =
      swarm.updated_at ? new Date(swarm.updated_at).toLocaleTimeString() : "never";
  }

  // Credit and the averaging plan change at most once per epoch: redraw them when the epoch moves.
  let shownEpoch = null;
  function onEpoch(epoch) {
    if (epoch === shownEpoch) return;
    shownEpoch = epoch;
    refreshLeaders();
    refreshPlan();
  }

  const leaders = document.getElementById("leaders");
  function refreshLeaders() {
    if (!leaders) return;
    fetch(`/api/v1/runs/${slug}/leaderboard?limit=10`).then((r) => r.json()).then((rows) => {
      const body = leaders.querySelector("tbody") || leaders;
      body.replaceChildren(...rows.map((row, i) => {
        const tr = document.createElement("tr");
        // The columns of templates/_leaders.html.
        const seen = row.last_seen ? row.last_seen.slice(0, 16).replace("T", " ") + " UTC" : "";
        const cells = [i + 1, row.username, row.team || "", row.samples.toLocaleString("en-US"),
                       row.held_samples ? row.held_samples.toLocaleString("en-US") : "",
                       `${row.runtime_seconds.toFixed(0)} s`, row.peers, seen];
        cells.forEach((value, column) => {
          const td = document.createElement("td");
          td.textContent = value;
          if (column > 2 && column < 7) td.className = "num";
          tr.appendChild(td);
        });
        return tr;
      }));
    });
  }

  const plan = document.getElementById("plan");
  function refreshPlan() {
    // 404 while the coordinator has published no plan: shown as "no averaging plan yet".
    if (plan) fetch(`/api/v1/runs/${slug}/plan`).then((r) => (r.ok ? r.json() : null)).then(showPlan);
  }

  function showPlan(p) {
    plan.hidden = !p;
    document.getElementById("no-plan").hidden = !!p;
    if (!p) return;
    // The rule of the duration macro in templates/_plan.html: milliseconds below a second.
    const secs = (v) => (v === null ? "not yet" : v < 0.01 ? (1000 * v).toFixed(1) + " ms"
                         : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s");
    document.getElementById("plan-predicted").textContent = secs(p.predicted_seconds);
    document.getElementById("plan-measured").textContent = secs(p.measured_seconds);
    document.getElementById("plan-lower-bound").textContent = secs(p.lower_bound_seconds);
    document.getElementById("plan-created").textContent = p.created_at.slice(0, 16).replace("T", " ") + " UTC";
    document.getElementById("plan-reason").textContent = p.reason ? "· " + p.reason : "";
    const table = document.getElementById("plan-peers");
    const roles = JSON.parse(table.dataset.roles);
    table.querySelector("tbody").replaceChildren(...p.peers.map((peer) => {
      // The columns of templates/_plan.html.
      const cells = [peer.fingerprint, peer.username, roles[peer.role] || peer.role,
                     (100 * peer.share).toFixed(1) + " %", peer.upload_mbps.toFixed(1), peer.download_mbps.toFixed(1)];
      const tr = document.createElement("tr");
      cells.forEach((value, column) => {
        const td = document.createElement("td");
        if (column === 0) td.appendChild(document.createElement("code")).textContent = value;
        else td.textContent = value;
        if (column > 2) td.className = "num";
        tr.appendChild(td);
      });
      return tr;
    }));
  }

  let last = null;
  fetch(`/api/v1/runs/${slug}/history?limit=${maxPoints}`).then((r) => r.json()).then((points) => {
    points.forEach(addPoint);
    if (points.length) last = points[points.length - 1].updated_at;
    Object.values(charts).forEach((c) => c.update());
  });

  const state = document.getElementById("live-state");
  const source = new EventSource(`/runs/${slug}/events`);
  source.onopen = () => { state.textContent = "· live"; };
  source.onerror = () => { state.textContent = "· reconnecting…"; };
  source.addEventListener("swarm", (event) => {
    const swarm = JSON.parse(event.data);
    show(swarm);
    onEpoch(swarm.epoch);
    if (swarm.updated_at && swarm.updated_at !== last) {
      last = swarm.updated_at;
      addPoint(swarm);
      Object.values(charts).forEach((c) => c.update());
    }
  });
})();

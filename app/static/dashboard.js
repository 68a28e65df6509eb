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

  // Credit changes once per epoch: refresh the contributors' table when the epoch moves.
  const leaders = document.getElementById("leaders");
  let shownEpoch = null;
  function refreshLeaders(epoch) {
    if (!leaders || epoch === shownEpoch) return;
    shownEpoch = epoch;
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
    refreshLeaders(swarm.epoch);
    if (swarm.updated_at && swarm.updated_at !== last) {
      last = swarm.updated_at;
      addPoint(swarm);
      Object.values(charts).forEach((c) => c.update());
    }
  });
})();

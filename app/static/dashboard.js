// Live dashboard: history from the JSON API, then server-sent events (app/web/live.py) as the swarm changes.
(function () {
  const root = document.getElementById("swarm");
  const slug = root.dataset.slug;
  const maxPoints = 300;
  // The whole run in at most maxPoints: one point per `step` seconds (the API thins the history to that).
  const started = Date.parse(root.dataset.started || "");
  const span = Number.isNaN(started) ? 0 : (Date.now() - started) / 1000;
  const step = Math.ceil(span / maxPoints);
  let lastPointAt = 0;
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
    const at = Date.parse(swarm.updated_at);
    if (at - lastPointAt < step * 1000) return;  // live updates join the chart at the history's resolution
    lastPointAt = at;
    const label = span > 86400 ? new Date(at).toLocaleString() : new Date(at).toLocaleTimeString();
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

  // The leaderboard and the plan arrive rendered by the server's own partials (templates/_leaders.html,
  // templates/_plan.html): the page has one renderer per table.
  function swap(id) {
    return (event) => { document.getElementById(id).innerHTML = event.data; };
  }

  let last = null;
  fetch(`/api/v1/runs/${slug}/history?limit=${maxPoints}&step=${step}`).then((r) => r.json()).then((points) => {
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
    if (swarm.updated_at && swarm.updated_at !== last) {
      last = swarm.updated_at;
      addPoint(swarm);
      Object.values(charts).forEach((c) => c.update());
    }
  });
  // Evaluation loss by checkpoint: the checkpointer's numbers, as the API lists them (newest first).
  const evalChart = chart("chart-eval", "evaluation loss", "#9333ea");
  fetch(`/api/v1/runs/${slug}/checkpoints`).then((r) => r.json()).then((list) => {
    list.filter((c) => c.eval_loss !== null).reverse().forEach((c) => {
      evalChart.data.labels.push(`epoch ${c.epoch}`);
      evalChart.data.datasets[0].data.push(c.eval_loss);
    });
    evalChart.update();
  });
  source.addEventListener("leaders", swap("leaders-live"));
  source.addEventListener("plan", swap("plan-live"));
})();

// Live dashboard: the run's whole history from the JSON API first, then server-sent events (app/web/live.py) extend
// it. Events open only once the history is drawn: a live point drawn first would hide every older one.
(function () {
  const root = document.getElementById("swarm");
  const slug = root.dataset.slug;
  const maxPoints = 300;
  // The whole history in about maxPoints: one point per `step` seconds (the API thins the history to that).
  const from = Date.parse(root.dataset.historyFrom || "");
  const span = Number.isNaN(from) ? 0 : Math.max(0, (Date.now() - from) / 1000);
  let step = Math.ceil(span / maxPoints);
  let lastPointAt = 0;
  const fmt = {
    samples_total: (v) => v.toLocaleString("en-US"),
    samples_per_second: (v) => v.toFixed(0),
    loss: (v) => (v === null ? "–" : v.toFixed(3)),
    eta_seconds: (v) => (v === null ? "–" : v.toFixed(0) + " s"),
  };

  function timeLabel(ms) {
    const at = new Date(ms);
    return span > 86400 ? at.toLocaleString() : at.toLocaleTimeString();
  }

  // x is a number: milliseconds since 1970 for the swarm's charts, the epoch for the evaluation chart.
  // xTitle: an axis title, and round ticks instead of the first and last point's (two long labels overlapped).
  function chart(id, label, color, xLabel, xTitle) {
    const x = { type: "linear", bounds: xTitle ? "ticks" : "data", ticks: { maxTicksLimit: 6, callback: xLabel } };
    if (xTitle) x.title = { display: true, text: xTitle };
    return new Chart(document.getElementById(id), {
      type: "line",
      data: { datasets: [{ label, data: [], borderColor: color, pointRadius: 0, tension: 0.2 }] },
      options: {
        animation: false, responsive: true, parsing: false, plugins: { legend: { display: false } },
        scales: { x },
      },
    });
  }
  const charts = {
    samples_per_second: chart("chart-throughput", "samples/s", "#2563eb", timeLabel),
    loss: chart("chart-loss", "loss", "#dc2626", timeLabel),
    peers_online: chart("chart-peers", "peers", "#16a34a", timeLabel),
  };

  // A run watched for days outgrows maxPoints: every other point goes, and live points come half as often.
  function thin() {
    for (const c of Object.values(charts)) c.data.datasets[0].data = c.data.datasets[0].data.filter((_, i) => i % 2);
    step = Math.max(1, step) * 2;
  }

  function addPoint(swarm) {
    if (!swarm.updated_at) return;
    const at = Date.parse(swarm.updated_at);
    if (at <= lastPointAt || at - lastPointAt < step * 1000) return;  // at the history's resolution, in order
    lastPointAt = at;
    for (const [field, c] of Object.entries(charts)) c.data.datasets[0].data.push({ x: at, y: swarm[field] });
    if (charts.loss.data.datasets[0].data.length > 2 * maxPoints) thin();
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

  function goLive() {
    const state = document.getElementById("live-state");
    const source = new EventSource(`/runs/${slug}/events`);
    source.onopen = () => { state.textContent = "· live"; };
    source.onerror = () => { state.textContent = "· reconnecting…"; };
    source.addEventListener("swarm", (event) => {
      const swarm = JSON.parse(event.data);
      show(swarm);
      addPoint(swarm);
      Object.values(charts).forEach((c) => c.update());
    });
    source.addEventListener("leaders", swap("leaders-live"));
    source.addEventListener("plan", swap("plan-live"));
  }

  fetch(`/api/v1/runs/${slug}/history?limit=${2 * maxPoints}&step=${step}`)
    .then((r) => (r.ok ? r.json() : []))
    .then((points) => {
      points.forEach(addPoint);
      Object.values(charts).forEach((c) => c.update());
    })
    .catch(() => {})  // no history drawn: the live points still come
    .finally(goLive);

  // Evaluation loss by epoch: every evaluation the checkpointer made, whichever archives are still kept.
  const evalChart = chart("chart-eval", "evaluation loss", "#9333ea", (epoch) => `${epoch}`, "epoch");
  evalChart.data.datasets[0].pointRadius = 3;  // a few points, each an evaluation
  fetch(`/api/v1/runs/${slug}/evaluations`).then((r) => (r.ok ? r.json() : [])).then((list) => {
    evalChart.data.datasets[0].data = list.map((e) => ({ x: e.epoch, y: e.eval_loss }));
    evalChart.update();
  });
})();

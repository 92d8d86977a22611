// rldiag's chart grid (app/dashboard/chart_grid.py): `data` (chart_grid.payload), the plotly JSON of the Compare
// page's panels (app/dashboard/grid_figure.py), drawn by window.Plotly, which the plotly.js bundle this
// file is appended to defines. Streamlit calls this again with new data on every rerun: Plotly.react
// updates the figure in place. Run names reach plotly already escaped (app.figures._text): plotly.js
// draws them as text.

export default function ({ data, parentElement }) {
  const Plotly = window.Plotly;
  let chart = parentElement.querySelector(":scope > .rldiag-chart-grid");
  if (!chart) {
    chart = document.createElement("div");
    chart.className = "rldiag-chart-grid";
    parentElement.appendChild(chart);
    // plotly's `responsive` follows the window only; the column also narrows when the sidebar opens.
    let width = chart.clientWidth;
    chart.rldiagObserver = new ResizeObserver(() => {
      if (chart.clientWidth === width) return; // the first call, on observe(), changes nothing
      width = chart.clientWidth;
      Plotly.Plots.resize(chart).then(() => fitLegend(Plotly, chart));
    });
    chart.rldiagObserver.observe(chart);
  }
  // Timed for bench/dashboard_load.py: parsing the figure, then plotly.js drawing it.
  const start = performance.now();
  // chart_grid.payload: UTF-8 JSON bytes {config, figure} (a Uint8Array here), parsed once
  const { config, figure } = JSON.parse(new TextDecoder().decode(data));
  const parsed = performance.now();
  // what grid_figure.py laid out, for fitLegend to grow from and shrink back to
  chart.rldiagTop = { top: figure.layout.margin.t, height: figure.layout.height };
  Plotly.react(chart, figure.data, figure.layout, config).then(() => {
    performance.mark("rldiag.chart_grid.start", { startTime: start });
    performance.measure("rldiag.chart_grid.parse", { start, end: parsed });
    performance.measure("rldiag.chart_grid.draw", { start: parsed, end: performance.now() });
    return fitLegend(Plotly, chart);
  });
  return () => {
    chart.rldiagObserver.disconnect();
    Plotly.purge(chart);
  };
}

// The top margin holds the legend's rows as grid_figure.py estimated them for a legend 800 px wide; in a
// narrower column, or with long run names, the legend wraps to more rows than that and its first rows
// would be cut off above the figure. Then grow the margin and the height by the difference (one more
// layout pass, only in that case), and shrink them back when the column widens again.
function fitLegend(Plotly, chart) {
  const legend = chart.querySelector(".legend");
  const layout = chart.layout;
  const base = chart.rldiagTop;
  if (!legend || !layout || !layout.margin || !base) return undefined;
  const top = Math.max(base.top, Math.ceil(legend.getBBox().height) + 4);
  if (top === layout.margin.t) return undefined;
  // A relayout of the height makes plotly.js pin the width it had (layout.width, autosize off): unpin it,
  // or the chart would no longer follow its column.
  return Plotly.relayout(chart, { "margin.t": top, height: base.height + (top - base.top) }).then(() => {
    delete chart.layout.width;
    chart.layout.autosize = true;
  });
}

"""The notebooks' plotting and table helpers (``notebooks/``; kept thin: the logic lives here),
one module per family of figures:

* :mod:`~simsched.plots.layouts`: one layout, as the model derives it under each behaviour
  profile (:func:`geometry_rows`) and per KV cache group on one token axis, tokens -> GPU
  blocks -> offload chunks -> hash units -> offload keys (:func:`draw_layout`);
* :mod:`~simsched.plots.sweeps`: which settings of one knob boot, crash or misbehave, target by
  target (:func:`sweep`, :func:`draw_sweep`);
* :mod:`~simsched.plots.campaigns`: a campaign's ``report.json`` (:func:`load_campaign`,
  :func:`draw_timeline`, :func:`draw_throughput`, :func:`draw_example_rate`,
  :func:`draw_coverage`, :func:`draw_arcs`, :func:`release_matrix`,
  :func:`draw_release_matrix`); :func:`write_report_plots` draws the PNGs ``report.md`` links;
* :mod:`~simsched.plots.findings`: one finding, its block and chunk occupancy per step parsed
  from ``simsched-trace/1`` lines (:func:`occupancy`, :func:`draw_occupancy`) and its state on
  each target (:func:`draw_release_strip`);
* :mod:`~simsched.plots.common`: what they share (:class:`Table`, :func:`save_figure`, the order
  of targets, the state colours).

The notebooks call them as ``from simsched import plots; plots.draw_layout(...)``: the names
below are that surface. matplotlib runs on the Agg backend when there is no display and no
notebook kernel, so every helper also works in a headless script or test.
:func:`save_figure` writes PNGs; the notebooks write ``docs/fig_*.png`` through it
(``$SIMSCHED_FIG_DIR`` sends them elsewhere).
"""

from simsched.plots.campaigns import (REPORT_PLOTS, campaign_figure, campaign_summary,
                                      draw_arcs, draw_coverage, draw_example_rate,
                                      draw_release_matrix, draw_throughput, draw_timeline,
                                      findings_table, load_campaign, release_matrix,
                                      write_report_plots)
from simsched.plots.common import (AFFECTED, CLEAN, CRASH_COLOURS, DATA_DIR, DOCS_DIR,
                                   MATRIX_COLOURS, NOT_IN_CAMPAIGN, NOT_RUN, REPO_ROOT, Table,
                                   close_pool, fig_dir, save_figure, version_key)
from simsched.plots.findings import (Occupancy, draw_occupancy, draw_release_strip, occupancy,
                                     release_states, trace_steps)
from simsched.plots.layouts import draw_layout, geometry_rows, layout_from
from simsched.plots.sweeps import (INVALID, MISBEHAVE, OK, STATE_COLOURS, UNSUPPORTED, Sweep,
                                   classify, draw_sweep, sweep, with_knob)

__all__ = [
    "AFFECTED", "CLEAN", "CRASH_COLOURS", "DATA_DIR", "DOCS_DIR", "INVALID", "MATRIX_COLOURS",
    "MISBEHAVE", "NOT_IN_CAMPAIGN", "NOT_RUN", "OK", "REPORT_PLOTS", "REPO_ROOT",
    "STATE_COLOURS", "UNSUPPORTED", "Occupancy", "Sweep", "Table", "campaign_figure",
    "campaign_summary", "classify", "close_pool", "draw_arcs", "draw_coverage",
    "draw_example_rate", "draw_layout", "draw_occupancy", "draw_release_matrix",
    "draw_release_strip", "draw_sweep", "draw_throughput", "draw_timeline", "fig_dir",
    "findings_table", "geometry_rows", "layout_from", "load_campaign", "occupancy",
    "release_matrix", "release_states", "save_figure", "sweep", "trace_steps", "version_key",
    "with_knob", "write_report_plots",
]

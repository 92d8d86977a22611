"""What `rldiag report --help` shows without loading the report builder (plotly, pandas, the detector)."""

DEFAULT_HTML = "rldiag-report.html"
DEFAULT_MARKDOWN = "rldiag-report.md"
EXAMPLES = """\
examples:
  rldiag report --group v0_vs_v1                     references and candidates by their rldiag.role tags
  rldiag report --reference RUN_A --reference RUN_B --candidate RUN_C --metrics policy/ratio_mean,grad/norm
  rldiag report --group masked_vs_unmasked --out reports/   reports/rldiag-report.html and .md
"""

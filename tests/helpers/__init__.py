"""Helpers the tests share, imported as `tests.helpers.<module>`: test modules and conftest files import no
other test module, no conftest and nothing from `bench/` (tests/test_layout_helpers.py checks it). Fixtures
stay in conftest files and call these. Code the benchmarks also run stays in `bench/` and is imported here once.

- bench_code: benchmark code the tests run or check (bench.team_load, bench.journal_scale, bench.run_all, ...)
- browser: Debian's Chromium through Playwright; `rldiag app` served and waited on (READY, serve, drawn)
- dash_store: the dashboard tests' store (its runs and the constants that describe them)
- dashboard: the dashboard under AppTest and what it drew (plotly figures, tables)
- divergence: synthetic traces and RL-like scenarios for the detector (bench.divergence_*)
- experiments: the masked-vs-unmasked experiment run for real into a temp store (run_mvu)
- gloo_job: the tiny 2-rank gloo and FSDP jobs of the distributed tests
- importers: runs written by TensorBoard's and wandb's own writers
- net: a free port, a real `mlflow server`, the dashboard's process group (bench._server)
- parity: what the session's engine-parity store holds
- postgres: a throwaway PostgreSQL server
- read_only: a store's fingerprint, Alembic downgrades, the dashboard with visitor settings
- runs: runs written as rldiag writes them (write_run) and as a foreign trainer does (log_raw, scripts)
- small_fs: a small tmpfs for the journal's fault tests
- tiny_hf: a tiny Qwen2 and tokenizer, a tiny Llama with its data and TrainingArguments
- training: small CPU training loops (fp16 under a GradScaler, a NaN loss, Trainer fp16 on the CPU)
- trl_runs: two short stock-TRL runs, one with NaN gradients
- writer: the metric writer's RAM backlog, sampled
"""

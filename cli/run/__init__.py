"""`hpckpt run [launcher options] JOB ...`: a distributed job under torchrun or msrun.

The launcher options go on the group, each job is a subcommand with its own options (the same
names as `hpckpt reshard`'s, `jobs.py`). The CLI checks the options, turns the job into a JSON
spec (`{"job": name, ...}`, absent or null = not given), builds the launcher's command line
(`launch_plan.py`), starts it and follows the ranks through their files (`supervise.py`), and
prints the report (`report.py`, `render.py`). The workers (`hpckpt.dist.jobs.worker`) are
started by file path: no framework, and nothing of `hpckpt.dist`, is imported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from hpckpt.cli.run import jobs

EXAMPLES = """Examples:

  hpckpt run --nproc-per-node 2 selftest                         check the launcher set-up
  hpckpt run --nproc-per-node 8 save -o ckpt/ --size 1.5GiB --dtype bf16
  hpckpt run --nproc-per-node 8 save -o ckpt/ --from model.safetensors --mesh 2x4 --placements R,S0
  hpckpt run --nproc-per-node 8 load ckpt/ --check
  hpckpt run --nproc-per-node 4 reshard ckpt/ -o ckpt-64/ --world-size 64
  hpckpt run --launcher msrun --nproc-per-node 4 bench --size 1GiB
  hpckpt run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8 load ckpt/
  hpckpt run --dry-run --launcher msrun --nproc-per-node 4 selftest   print the launcher's command line
"""

app = typer.Typer(name="run", help="Run a distributed job (save, load, reshard, bench, selftest) under torchrun or msrun.",
                  no_args_is_help=True, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})

LauncherName = Literal["torchrun", "msrun"]


@app.callback()
def run(
    ctx: typer.Context,
    launcher: Annotated[LauncherName, typer.Option("--launcher", help="The launcher (found in the active environment).")] = "torchrun",
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1, help="Worker processes on this node.")] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes in the job (one `hpckpt run` on each).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This node's rank, 0..nnodes-1.")] = 0,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="Address of node 0 (multi-node).")] = None,
    master_port: Annotated[Optional[int], typer.Option("--master-port", min=1, max=65535,
                                                       help="A free port on node 0 (multi-node).")] = None,
    log_dir: Annotated[Optional[Path], typer.Option(
        "--log-dir", help="Where the ranks' logs and reports go (default: a new JOB-TIME-PID/ under "
        "$HPCKPT_LOG_DIR, else under TMPDIR/hpckpt-runs/).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the launcher's command line; launch nothing.")] = False,
) -> None:
    """Run a distributed job under torchrun or msrun; a failure on any rank stops the job."""
    if node_rank >= nnodes:
        raise typer.BadParameter(f"--node-rank {node_rank} is not a node of --nnodes {nnodes} (0..{nnodes - 1})")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise typer.BadParameter("--nnodes > 1 needs --master-addr and --master-port (node 0's address)")
    ctx.obj = {"launcher": launcher, "nproc_per_node": nproc_per_node, "nnodes": nnodes, "node_rank": node_rank,
               "master_addr": master_addr, "master_port": master_port, "log_dir": log_dir, "dry_run": dry_run}


app.command("selftest")(jobs.selftest)
app.command("save")(jobs.save)
app.command("load")(jobs.load)
app.command("reshard")(jobs.reshard)
app.command("bench")(jobs.bench)

"""`clusterctl plan`: bytes, seconds and comm share of a data-parallel GPT-2 gradient sync.

The arithmetic lives in orchestrator/plan.py; this is options, a rich table, a small chart,
and `--json`.  Conventions: docs/plan.md.
"""

from __future__ import annotations

import json

import click

from orchestrator import plan as P

PRECISIONS = ("fp32", "fp16", "bf16")


def _csv_ints(ctx, param, value):
    if value is None:
        return None
    try:
        out = sorted({int(x) for x in str(value).split(",") if x.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma list of integers like 1,2,4,8") from None
    if not out or out[0] < 1:
        raise click.BadParameter("accumulation steps must be integers >= 1")
    return out


def _bandwidths(ctx, param, values):
    out = []
    for v in values:
        for part in v.split(","):
            if part.strip():
                try:
                    out.append((part.strip(), P.parse_bandwidth(part)))
                except ValueError as e:
                    raise click.BadParameter(str(e)) from None
    return out


def _latency(ctx, param, value):
    if value is None:
        return None
    try:
        return P.parse_latency(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _load_link(path: str) -> P.Link:
    try:
        with open(path) as f:
            doc = json.load(f)
        bw, lat = float(doc["bandwidth_bps"]), float(doc.get("latency_s") or 0.0)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.BadParameter(f"{path}: not a netbench --save file ({e.__class__.__name__}: {e})",
                                 param_hint="--link") from None
    if bw <= 0:
        raise click.BadParameter(f"{path}: bandwidth_bps must be > 0", param_hint="--link")
    return P.Link(bw, lat, P.MEASURED_EFFICIENCY)


def nodes_from_inventory(path: str) -> tuple[int, int, dict[str, str]]:
    """The inventory hook: (nodes, GPUs per node, the trainer's settings) of an inventory file.
    Nodes with different GPU counts plan with the smallest (the slowest node sets a synchronous
    step); a node without a `gpus` entry counts as 1; spares are not counted (they sit out until a
    restart). The settings ({"preset", "precision", "comm_hook"}) are what the bundled trainer will
    run with: its train.args, else its own defaults; {} when the inventory runs another script."""
    from orchestrator.errors import InventoryError
    from orchestrator.inventory import load_inventory

    try:
        inv = load_inventory(path)
    except InventoryError as e:
        raise click.BadParameter(str(e), param_hint="--inventory") from None
    ranked = [n for n in inv.nodes if not n.spare] or list(inv.nodes)
    if not ranked:
        raise click.BadParameter(f"{path} lists no nodes", param_hint="--inventory")
    return len(ranked), min((n.gpus or 1) for n in ranked), _trainer_settings(inv.train)


def _trainer_settings(train) -> dict[str, str]:
    if train.script or train.module != "trainer":
        return {}
    from trainer.config import TrainConfig  # no torch: the trainer's defaults, read cheaply

    defaults = TrainConfig()
    out = {"precision": defaults.precision, "comm_hook": defaults.comm_hook}
    args = list(train.args)
    for flag, key, choices in (("--preset", "preset", P.PRESETS), ("--precision", "precision", PRECISIONS),
                               ("--comm-hook", "comm_hook", P.HOOKS)):
        for i, a in enumerate(args):
            value = args[i + 1] if a == flag and i + 1 < len(args) else a.partition("=")[2] \
                if a.startswith(flag + "=") else None
            if value in choices:
                out[key] = value
    return out


def _model(preset, config_file, overrides) -> P.ModelSpec:
    try:
        if config_file:
            from orchestrator.plan.measure import load_model_file

            base = load_model_file(config_file)
        else:
            base = P.model_spec(preset)
        return P.override(base, **overrides)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _bar(share: float, width: int = 20) -> str:
    blocks = " ▏▎▍▌▋▊▉█"
    cells = share * width
    full = int(cells)
    rest = int((cells - full) * 8)
    return ("█" * full + (blocks[rest] if full < width and rest else "")).ljust(width)


@click.command("plan")
@click.option("--preset", type=click.Choice(list(P.PRESETS)), default=None,
              help="Model size [default: the inventory's train.args --preset with -i, else tiny].")
@click.option("--n-layer", type=int)
@click.option("--n-embd", type=int)
@click.option("--n-head", type=int)
@click.option("--n-positions", "--ctx", "n_positions", type=int)
@click.option("--vocab-size", type=int)
@click.option("--n-inner", type=int, help="MLP width (default 4 x n_embd).")
@click.option("--pad-vocab-to", "--pad-vocab", "pad_vocab_to", type=click.IntRange(1),
              help="Round the vocabulary up to a multiple (64: 50257 -> 50304).")
@click.option("--untied", is_flag=True, help="Separate LM head (GPT-2 ties it to the embedding).")
@click.option("--config", "config_file", type=click.Path(exists=True),
              help="Model from a file: config.json, a HF save dir, a trainer checkpoint or a state dict "
                   "(field options above still override it).")
@click.option("--nodes", type=click.IntRange(1), help="Nodes (default 2, or the inventory's).")
@click.option("--gpus-per-node", type=click.IntRange(1), help="GPUs per node (default 1, or the inventory's).")
@click.option("-i", "--inventory", type=click.Path(exists=True, dir_okay=False),
              help="Take nodes and GPUs per node from an inventory.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Autocast precision (grads stay fp32: the bytes depend on --comm-hook) [default: the "
                   "trainer's with -i, else fp16].")
@click.option("--comm-hook", type=click.Choice(P.HOOKS), default=None,
              help="What DDP sends: none = fp32 grads (4 B/param), fp16/bf16 = 2 B/param, powersgd = rank-r "
                   "factors [default: the trainer's with -i, else none].")
@click.option("--powersgd-rank", type=click.IntRange(1), default=4, show_default=True)
@click.option("--algo", type=click.Choice(["auto", "ring", "tree", "hierarchical"]), default="auto",
              show_default=True, help="auto: hierarchical when GPUs per node > 1, else ring.")
@click.option("--accum", callback=_csv_ints, default="1,2,4,8,16,32", show_default=True,
              help="Gradient accumulation steps to tabulate (comma list).")
@click.option("--bandwidth", multiple=True, callback=_bandwidths,
              help="Link rate, repeatable or comma list: 1gbit, 10gbit, 100mbit, 25Gbps, 1.2GB/s "
                   "[default: 1gbit,10gbit,100gbit]. Nominal rates are derated by --efficiency.")
@click.option("--latency", callback=_latency, default="50us", show_default=True, help="One-way latency: 50us, 0.2ms.")
@click.option("--efficiency", type=click.FloatRange(0.01, 1.0), default=P.NOMINAL_EFFICIENCY, show_default=True,
              help="Goodput / line rate for --bandwidth (TCP: ~0.94). --link uses 1.0 (measured goodput).")
@click.option("--intra-bandwidth", default="2400gbit", show_default=True,
              help="Intra-node GPU link for hierarchical all-reduce (NVLink-class default).")
@click.option("--link", "link_file", type=click.Path(exists=True, dir_okay=False),
              help="A `clusterctl netbench --save` JSON: its bandwidth_bps/latency_s (efficiency 1.0).")
@click.option("--step-time", type=float, help="Compute seconds per micro-step (default 1.0 s).")
@click.option("--measure-step", is_flag=True,
              help="Time a forward+backward micro-step of the model here (cuda if present, else cpu).")
@click.option("--peak-tflops", type=float, help="Device peak TFLOP/s (estimate the step from FLOPs instead).")
@click.option("--mfu", type=float, help="Model FLOPs utilization for --peak-tflops (default 0.4).")
@click.option("--micro-batch", type=click.IntRange(1), default=16, show_default=True,
              help="Sequences per micro-step (with --peak-tflops).")
@click.option("--seq-len", type=click.IntRange(1), help="Tokens per sequence (default: the context).")
@click.option("--overlap", is_flag=True, help="Model DDP's overlap of the all-reduce with the last backward.")
@click.option("--target-share", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True), default=0.2,
              show_default=True, help="Recommend the smallest accumulation keeping comm under this share.")
@click.option("--json", "as_json", is_flag=True)
def plan_command(preset, n_layer, n_embd, n_head, n_positions, vocab_size, n_inner, pad_vocab_to, untied,
                 config_file, nodes, gpus_per_node, inventory, precision, comm_hook, powersgd_rank, algo, accum,
                 bandwidth, latency, efficiency, intra_bandwidth, link_file, step_time, measure_step, peak_tflops,
                 mfu, micro_batch, seq_len, overlap, target_share, as_json):
    """Plan a data-parallel GPT-2 run's gradient sync: bytes, seconds, comm share, a recommendation."""
    if inventory:
        inv_nodes, inv_gpus, trainer = nodes_from_inventory(inventory)
        nodes, gpus_per_node, preset = nodes or inv_nodes, gpus_per_node or inv_gpus, preset or trainer.get("preset")
        precision, comm_hook = precision or trainer.get("precision"), comm_hook or trainer.get("comm_hook")
    precision, comm_hook = precision or "fp16", comm_hook or "none"
    m = _model(preset or "tiny", config_file, dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                                         vocab_size=vocab_size, n_inner=n_inner, pad_vocab_to=pad_vocab_to,
                                         tied=False if untied else None))
    nodes, gpus_per_node = nodes or 2, gpus_per_node or 1
    if link_file and bandwidth:
        raise click.UsageError("give --link or --bandwidth, not both")
    if link_file:
        lk = _load_link(link_file)
        links = [(f"measured {P.fmt_bps(lk.bandwidth_bps)}", lk)]
    else:
        bandwidth = bandwidth or [(b, P.parse_bandwidth(b)) for b in ("1gbit", "10gbit", "100gbit")]
        links = [(label, P.Link(bps, latency, efficiency)) for label, bps in bandwidth]
    try:
        intra = P.Link(P.parse_bandwidth(intra_bandwidth), 5e-6, 1.0)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--intra-bandwidth") from None
    if sum(x is not None and x is not False for x in (step_time, peak_tflops, measure_step)) > 1:
        raise click.UsageError("give one of --step-time, --peak-tflops and --measure-step")
    if seq_len is not None and seq_len > m.n_positions:
        raise click.BadParameter(f"{seq_len} exceeds the model's context of {m.n_positions} tokens",
                                 param_hint="--seq-len")
    step_source = "given" if step_time is not None else "peak x MFU" if peak_tflops is not None else \
        "assumed 1 s: --step-time or --measure-step for yours"
    if measure_step:
        from orchestrator.plan.measure import measure_step_seconds

        try:
            step_time, dev = measure_step_seconds(m, micro_batch, seq_len, precision=precision)
        except (ValueError, RuntimeError) as e:  # RuntimeError: out of memory
            raise click.UsageError(f"--measure-step failed: {e}") from None
        step_source = f"measured on {dev}"
    if mfu is not None and peak_tflops is None:
        raise click.UsageError("--mfu needs --peak-tflops")
    try:
        step_s = P.compute_seconds(m, step_time=step_time, peak_tflops=peak_tflops, mfu=mfu,
                                   tokens_per_micro_step=micro_batch * (seq_len or m.n_positions), seq_len=seq_len)
        plan = P.make_plan(m, nodes=nodes, gpus_per_node=gpus_per_node, hook=comm_hook,
                           powersgd_rank=powersgd_rank, accums=accum, links=links, step_s=step_s,
                           intra=intra, algo=algo, overlap=overlap, target_share=target_share)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    doc = plan.to_json() | {"precision": precision, "step_source": step_source}
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    _render(plan, precision, step_source)


def _render(plan: P.Plan, precision: str, step_source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    m = plan.model
    hook = plan.hook + (f" rank {plan.powersgd_rank}" if plan.hook == "powersgd" else "")
    con.print(f"[bold]GPT-2[/] L={m['n_layer']} d={m['n_embd']} heads={m['n_head']} ctx={m['n_positions']} "
              f"vocab={m['vocab_size']}{' (padded)' if m['pad_vocab_to'] > 1 else ''}: "
              f"[bold]{plan.params:,}[/] parameters")
    con.print(f"{plan.nodes} node(s) x {plan.gpus_per_node} GPU(s), {precision} autocast, comm hook {hook}: "
              f"S = {plan.sync_bytes / 1e6:.1f} MB per sync; {plan.algo} all-reduce sends "
              f"{plan.bytes_per_rank / 1e6:.1f} MB per GPU over the network; compute {plan.step_s:.3g} s "
              f"per micro-step ({step_source}){', overlapped' if plan.overlap else ''}")
    if plan.hook == "none" and precision != "fp32":
        con.print(f"  note: under {precision} autocast DDP still all-reduces fp32 gradients (the parameter "
                  f"dtype); --comm-hook {precision} sends 2 B/param")
    # the caption is printed as a line of its own: as a title it wrapped to the table's width
    con.print("comm share and speed-up vs 1 GPU, per accumulation steps and link (seconds per sync in the header):")
    t = Table()
    t.add_column("accum", justify="right")
    for lk in plan.links:
        t.add_column(f"{lk['label']}\n{lk['sync_s']:.3g} s/sync", justify="right")
    for i, a in enumerate(plan.accums):
        cells = []
        for lk in plan.links:
            r = lk["rows"][i]
            style = "green" if r["comm_share"] <= plan.target_share else "red"
            cells.append(f"[{style}]{r['comm_share']:.1%}[/] x{r['speedup']:.2f}")
        t.add_row(str(a), *cells)
    con.print(t)
    con.print("comm share vs accumulation:")
    for lk in plan.links:
        con.print(f"  {lk['label']}")
        for r in lk["rows"]:
            con.print(f"    {r['accum']:>4} │{_bar(r['comm_share'])}│ {r['comm_share']:6.1%}")
    con.print("[bold]recommendation[/]:")
    for e in plan.recommendation["per_link"]:
        con.print(f"  {e['text']}")

"""How long layout="auto" takes to decide, and what it chooses, for an example config: the search run as it runs on
the config's ranks (waves of as many candidates as ranks), each wave measured here by ``--workers`` child processes.

    PYTHONPATH=. .venv/bin/python benchmarks/auto_layout.py --config examples/llama8b_auto.yaml --gpu_memory 80
    PYTHONPATH=. .venv/bin/python benchmarks/auto_layout.py --config examples/llama70b_pp_tp_fsdp.yaml --gpu_memory 80 \
        --trainer.strategy.init_args.layout=auto ... (the sizes the config gives stay fixed; override them with null)

It prints the choice, each measured candidate's CPU time, and the decision's wall time on the config's ranks,
projected: a rank's child starts (timed here), then each wave lasts as long as its slowest measurement (each rank's
child measures one candidate a wave, on its share of the machine's cores). ``--waves N`` stops after N waves (the
first wave of a large world is what a first projection needs); ``--wave_size 1`` measures one candidate at a time,
no more than the choice needs (a world's waves measure more at once).
"""

from __future__ import annotations

import argparse
import time

from lightning_automodel.cli.config import configured
from lightning_automodel.planning.child_process import ChildProcess
from lightning_automodel.planning.search.fitting import NoLayoutFits, choose_layout
from lightning_automodel.planning.search.layouts import Outcome, tensor_budget
from lightning_automodel.planning.search.workers import ChildWorkers, Measurements


def child_start_seconds() -> float:
    """A child process's start to its first result: the interpreter, torch, transformers and the package."""
    started = time.monotonic()
    with ChildProcess(purpose="the benchmark") as child:
        child.submit(time.monotonic, {})
        child.result()
    return time.monotonic() - started


class _Limited:
    """The workers' evaluation, for at most ``waves`` waves (the search then ends without a choice), each candidate
    printed as it is measured: a run cut short still shows what it measured."""

    def __init__(self, workers: ChildWorkers, waves: int | None, *, budget: float) -> None:
        self.workers, self.waves, self.done, self.budget = workers, waves, 0, budget

    def __call__(self, wave):
        if self.waves is not None and self.done >= self.waves:
            return ["not measured (--waves)"] * len(wave)
        self.done += 1
        outcomes = self.workers(wave)
        for candidate, outcome in zip(wave, outcomes, strict=True):
            if isinstance(outcome, Outcome):
                verdict = "fits" if outcome.memory_bytes <= self.budget else "too large"
                found = f"{outcome.memory_bytes / 2**30:.1f} GiB, {verdict}, {outcome.seconds:.1f} s of CPU"
            else:
                found = f"refused: {outcome}"
            print(f"wave {self.done}: {candidate.name} {candidate.checkpointing}: {found}", flush=True)
        peaks = ", ".join(f"{_peak_rss(pid) / 2**30:.1f} GiB" for pid in self.workers.pids)
        print(f"wave {self.done}: the children's resident peaks so far: {peaks}", flush=True)
        return outcomes


def _peak_rss(pid: int) -> int:
    """A process's resident-set high-water mark, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpu_memory", type=float, required=True, help="GiB per GPU")
    parser.add_argument("--workers", type=int, default=2, help="child processes measuring here side by side")
    parser.add_argument("--waves", type=int, help="measure at most this many waves")
    parser.add_argument(
        "--wave_size",
        type=int,
        help="candidates a wave (default: the config's ranks); 1 measures no more than the choice needs, one at a time",
    )
    args, overrides = parser.parse_known_args()
    config = configured(args.config, *overrides)
    space = config.strategy.options.search
    if space is None:
        parser.error("the config's layout is not auto: add --trainer.strategy.init_args.layout=auto")
    ranks, shape = config.world_size, config.batch_shape()
    wave_size = args.wave_size or ranks
    hardware = config.hardware(args.gpu_memory)
    start = child_start_seconds()
    measurements = Measurements(
        config.model, batch_shape=shape, budget=tensor_budget(args.gpu_memory), step=config.step_options()
    )
    started = time.monotonic()
    with ChildWorkers(measurements, count=args.workers) as workers:
        evaluate = _Limited(workers, args.waves, budget=tensor_budget(args.gpu_memory))
        try:
            choice = choose_layout(
                config.model,
                ranks,
                hardware=hardware,
                batch_shape=shape,
                space=space,
                evaluate=evaluate,
                workers=wave_size,
                step=config.step_options(),
            )
            record = choice.record
            print(choice)
        except NoLayoutFits as refusal:
            print(refusal)
            record = None
    here = time.monotonic() - started
    if record is None:
        return
    waves = [[record.outcomes[index] for index in wave] for wave in record.waves]
    slowest = [max((o.seconds for o in wave if isinstance(o, Outcome)), default=0.0) for wave in waves]
    cpu = [o.seconds for wave in waves for o in wave if isinstance(o, Outcome)]
    print(
        f"\n{len(cpu)} candidates measured in {len(waves)} wave(s) of up to {wave_size}:"
        f" {min(cpu):.1f}-{max(cpu):.1f} s of CPU each ({sum(cpu) / len(cpu):.1f} s on average), {here:.0f} s of"
        f" wall time here over {args.workers} workers; a child starts in {start:.1f} s"
    )
    projected = start + sum(slowest)
    print(
        f"projected on {wave_size} ranks (one candidate each a wave): {start:.1f} s + the waves' slowest"
        f" ({' + '.join(f'{s:.1f}' for s in slowest)} s) = {projected:.0f} s"
    )


if __name__ == "__main__":
    main()

"""The one command-line entry point: `agent-rl <subcommand> ...`.

Subcommands import their module lazily, so `agent-rl sandbox serve` works with only the sandbox
extra installed and `agent-rl doctor` answers even when torch is missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module with main(argv) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": (
        "agent_rl.doctor",
        "report what this machine can do (torch, CUDA, vLLM, Docker, bubblewrap, cgroups)",
    ),
    "tiny-model": ("agent_rl.tiny_model_cli", "build the offline tiny Qwen2 model + tokenizer into a folder"),
    "sandbox": ("sandbox.__main__", "run the Python execution service (sandbox serve --host --port)"),
    "train": ("agent_rl.train", "train a policy from a YAML config (--config, --set key=value)"),
    "eval": ("agent_rl.evaluate", "score a model or checkpoint on an environment's tasks"),
    "inspect": ("agent_rl.inspect", "render a run's trajectories with policy/tool tokens and advantages"),
    "experiment": ("agent_rl.experiment", "run an estimator x group-size x seed grid and write a report"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="agent-rl", description="Train LLM agents that use tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    available = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            available[name] = module
            sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in available:
        parser.print_help()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nagent-rl: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(available[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

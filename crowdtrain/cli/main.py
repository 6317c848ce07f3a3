"""The `crowdtrain` command: parse the edge, run the node, the status reader or the check, map errors to exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from crowdtrain import __version__
from crowdtrain.errors import CrowdtrainError

if TYPE_CHECKING:
    from crowdtrain.node.addresses import JoinAddress

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The `crowdtrain` command line: `run`, `status`, `check`, `invite`, `eval` and `preset` with their flags."""
    parser = argparse.ArgumentParser(prog="crowdtrain", description="Lend this machine to a shared training run.")
    parser.add_argument("--version", action="version", version=f"crowdtrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,status,check,invite,eval,preset}")

    run = commands.add_parser("run", help="start a node: found a run, or join one with --initial-peers")
    _add_swarm_flags(run)
    run.add_argument(
        "--listen", nargs="+", metavar="MADDR", help="addresses to listen on (default: all interfaces, port 31330)"
    )
    run.add_argument(
        "--announce", nargs="+", metavar="MADDR", help="addresses peers should dial, e.g. a forwarded public port"
    )
    run.add_argument(
        "--no-relay",
        action="store_const",
        const=False,
        dest="relay",
        help="behind a NAT, don't reserve a slot on a peer's relay (only peers this node dials can reach it)",
    )
    run.add_argument("--identity", metavar="PATH", help="identity key file (default: <state-dir>/identity.key)")
    run.add_argument("--run-file", metavar="RUN.toml|PRESET", help="found a run from this manifest or preset (demo)")
    run.add_argument("--device", metavar="auto|cpu|cuda[:N]", help="device to train on (default: auto)")
    run.add_argument("--role", metavar="ROLE", help="auto, trainer, aggregator, expert-host or client (default: auto)")
    run.add_argument("--config", metavar="NODE.toml", help="TOML file with any of these settings")

    status = commands.add_parser("status", help="show the swarm: the run's progress and every peer")
    _add_swarm_flags(status)
    status.add_argument("--json", action="store_const", const=True, help="print one JSON object")
    status.add_argument(
        "--watch", type=float, metavar="SECONDS", dest="watch_s", help="refresh every SECONDS until Ctrl-C"
    )

    check = commands.add_parser(
        "check", help="pre-flight: device, throughput, bandwidth and reachability, and the role to expect"
    )
    _add_swarm_flags(check)
    check.add_argument("--listen", nargs="+", metavar="MADDR", help="addresses to listen on (default: as run)")
    check.add_argument("--announce", nargs="+", metavar="MADDR", help="addresses peers should dial back (as run)")
    check.add_argument("--device", metavar="auto|cpu|cuda[:N]", help="device to measure (default: auto)")
    check.add_argument("--json", action="store_const", const=True, help="print one JSON object")

    invite = commands.add_parser("invite", help="founder of an invite-only run: issue a join token")
    invite.add_argument("--state-dir", default="~/.crowdtrain", help="the founder's state directory")
    invite.add_argument("--identity", metavar="PATH", help="identity key file (default: <state-dir>/identity.key)")
    invite.add_argument("--run-id", default="", metavar="ID", help="the run, when this node founded several")
    invite.add_argument("--expires", default="7d", metavar="DURATION", help="how long the token admits (default: 7d)")
    invite.add_argument("--label", default="", metavar="TEXT", help="a note on whom it is for, kept in the token")
    invite.add_argument(
        "--max-identities",
        type=int,
        default=1,
        metavar="N",
        help="how many nodes (identities) may use the token at once, 1 to 1024 (default: 1; a volunteer running "
        "several machines needs one per machine)",
    )
    invite.add_argument(
        "--revoke",
        metavar="TOKEN|LABEL|FINGERPRINT",
        help="revoke instead: a join token, or the label or fingerprint of one issued here; the founder's daemon "
        "publishes the revocation",
    )

    evaluate = commands.add_parser(
        "eval", help="held-out loss and perplexity of a checkpoint, optionally without some pipeline stages"
    )
    evaluate.add_argument("--run-file", required=True, metavar="RUN.toml|PRESET", help="the run's manifest or preset")
    evaluate.add_argument("--run-id", metavar="ID", help="the run's id, when the run file's was overridden")
    evaluate.add_argument("--checkpoint", metavar="PATH", help="a checkpoint (default: the newest in the state dir)")
    evaluate.add_argument("--state-dir", default="~/.crowdtrain", metavar="DIR", help="the node that trained it")
    evaluate.add_argument("--stages", type=int, default=1, metavar="S", help="cut the layers into S stages")
    evaluate.add_argument("--drop", type=int, nargs="+", default=[], metavar="STAGE", help="stages to leave out")
    evaluate.add_argument("--sweep", action="store_true", help="score every subset of stages 1..S-1")
    evaluate.add_argument("--batches", type=int, default=8, metavar="N", help="held-out batches (default: 8)")
    evaluate.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows per batch (default: 8)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.add_argument(
        "--initial-peers", nargs="+", metavar="MADDR", help="a SkipPipe run: take each stage from the swarm's nodes"
    )
    evaluate.add_argument(
        "--join-token",
        metavar="TOKEN",
        help="with --initial-peers: an invite-only run's token (or CROWDTRAIN_JOIN_TOKEN)",
    )
    evaluate.add_argument(
        "--data-cache-dir",
        metavar="DIR",
        help="where the run's tokenised data is cached, as the daemon's data_cache_dir (or CROWDTRAIN_DATA_CACHE_DIR; "
        "default: <state dir>/data-cache)",
    )

    preset = commands.add_parser("preset", help="print a preset as a run file to start from, or list the presets")
    preset.add_argument("name", nargs="?", metavar="NAME", help="the preset to print (default: list them all)")
    return parser


def _add_swarm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="address(es) of peers in the swarm")
    parser.add_argument("--state-dir", metavar="DIR", help="this node's state directory (default: ~/.crowdtrain)")
    parser.add_argument("--run-id", metavar="ID", help="the run to join or show when the swarm holds several")
    parser.add_argument(
        "--run-key", metavar="PEER_ID", help="accept only a run founded by this peer (the founder prints it)"
    )
    parser.add_argument(
        "--join-token", metavar="TOKEN", help="join an invite-only run with this token from its founder"
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        metavar="SECONDS",
        dest="bootstrap_timeout_s",
        help="give up when no initial peer answers in this time (default: 20)",
    )
    parser.add_argument("--log-format", choices=("text", "json"), help="log lines for people (text) or machines (json)")
    parser.add_argument("-v", "--verbose", action="count", help="more logs: -v shows hivemind's, -vv debug")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    verbose = args.get("verbose") or 0
    try:
        if command == "run":
            return _run(args)
        if command == "check":
            return _check(args)
        if command == "invite":
            return _invite(args)
        if command == "eval":
            return _eval(args)
        if command == "preset":
            return _preset(args)
        return _status(args)
    except CrowdtrainError as e:
        print(f"crowdtrain: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("crowdtrain: interrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if verbose:
            logger.exception("unexpected error")
        print(f"crowdtrain: unexpected error: {e} (rerun with -v for the traceback).", file=sys.stderr)
        return 1


def _run(args: dict[str, Any]) -> int:
    from crowdtrain.node.config import NodeConfig, environment, resolve_config
    from crowdtrain.node.logs import setup_logging

    config_file = args.pop("config")
    config = resolve_config(NodeConfig, _tuples(args), env=environment(), config_file=config_file)
    setup_logging(config.log_format, config.verbose)
    if config.run_file:  # a bad run file is refused before anything is loaded, created or locked
        from crowdtrain.manifest import load_run_file

        load_run_file(config.run_file, run_id=config.run_id or None)
    from crowdtrain.node.daemon import Daemon, ReadyInfo

    stop = threading.Event()
    state = {"ready": False}

    def on_ready(info: ReadyInfo) -> None:
        state["ready"] = True
        if config.log_format == "json":
            logger.info(f"ready: peer {info.peer_id} in run {info.run_id!r} at {' '.join(info.multiaddrs)}")
        else:
            _print_ready(info, config.state_dir)

    def on_signal(signum: int, _frame: object) -> None:
        if not state["ready"]:
            raise KeyboardInterrupt  # still starting: abandon the start-up at once
        if stop.is_set():
            logger.warning("second signal: exiting at once, without leaving the swarm cleanly")
            os._exit(EXIT_INTERRUPTED)
        logger.info(f"received {signal.Signals(signum).name}: leaving the swarm (press Ctrl-C again to force)")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    Daemon(config, stop, on_ready).run()
    return 0


def _print_ready(info: Any, state_dir: str) -> None:
    role = "founded" if info.founded else "joined"
    roles = "its role chosen by measurement" if info.role is None else f"as {info.role.value}"
    print(f"crowdtrain {__version__}: peer {info.peer_id} {role} run '{info.run_id}', {roles}, on {info.device}")
    print("Visible addresses:")
    for address in info.multiaddrs:
        print(f"  {address}")
    for line in join_lines(info.join, info.run_key):
        print(line)
    print("To watch the swarm from this machine, run:")
    state_flag = "" if state_dir == "~/.crowdtrain" else f" --state-dir {state_dir}"
    print(f"  crowdtrain status --watch 2{state_flag}", flush=True)


def join_lines(joining: JoinAddress, run_key: str) -> list[str]:
    """The join command, with where it works: a public address as it is; the peer this node joined through; or
    this node's own private address, with how to make the node reachable from the internet."""
    from crowdtrain.node.addresses import JoinVia

    command = f"  crowdtrain run --initial-peers {joining.address} --run-key {run_key}"
    if joining.via == JoinVia.OWN:
        return ["To join from another machine, run:", command]
    if joining.via == JoinVia.INITIAL_PEER:
        return ["To join from another machine, run (it names the peer this node joined through, as this node's "
                "own addresses are private):", command]  # fmt: skip
    where = "this machine" if joining.on_loopback else "this node's own network"
    port = joining.port or "<port>"
    return [
        f"To join from {'this machine' if joining.on_loopback else 'another machine on this network'}, run:",
        command,
        f"This address works only on {where}; to be reachable from the internet, forward TCP port {port} of "
        f"your router to this machine and restart with --announce /ip4/<your public IP>/tcp/{port}.",
    ]


def _status(args: dict[str, Any]) -> int:
    from rich.console import Console

    from crowdtrain.cli.status import show_status
    from crowdtrain.node.config import StatusConfig, environment, resolve_config
    from crowdtrain.node.logs import setup_logging

    config = resolve_config(StatusConfig, _tuples(args), env=environment())
    setup_logging(config.log_format, config.verbose, quiet=True)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        if stop.is_set() or not config.watch_s:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # Piped output (scripts, `watch`) gets full rows instead of rich's 80-column default.
    show_status(config, stop, Console() if sys.stdout.isatty() else Console(width=240))
    return 0


def _check(args: dict[str, Any]) -> int:
    from rich.console import Console

    from crowdtrain.cli.check import print_check, run_check
    from crowdtrain.node.config import CheckConfig, environment, resolve_config
    from crowdtrain.node.logs import setup_logging

    config = resolve_config(CheckConfig, _tuples(args), env=environment())
    setup_logging(config.log_format, config.verbose, quiet=True)

    def on_signal(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    result = run_check(config)
    print_check(result, config.json, Console() if sys.stdout.isatty() else Console(width=240))
    return 0


def _invite(args: dict[str, Any]) -> int:
    from pathlib import Path

    from crowdtrain.cli.invite import make_invite, revoke_invites
    from crowdtrain.dht.admission import parse_join_token
    from crowdtrain.dht.invites import fingerprint

    state_path = Path(args["state_dir"]).expanduser()
    identity_path = Path(args["identity"]).expanduser() if args["identity"] else state_path / "identity.key"
    if args["revoke"] is not None:
        revoked, run_id, path = revoke_invites(state_path, identity_path, args["run_id"], args["revoke"])
        print(f"Revoked in run '{run_id}': {', '.join(revoked)} (signed list: {path}).")
        print("The founder's daemon publishes it within a minute while it runs; nodes refuse those tokens once read.")
        return 0
    token, run_id = make_invite(
        state_path, identity_path, args["run_id"], args["expires"], args["label"], args["max_identities"]
    )
    identities = args["max_identities"]
    print(
        f"Join token for run '{run_id}' (valid {args['expires']}, for {identities} "
        f"{'node' if identities == 1 else 'nodes'} at once; keep it secret, it admits whoever holds it):"
    )
    print(f"  {token}")
    print(f"Its fingerprint, to revoke it: {fingerprint(parse_join_token(token).certificate.invite_public_key)}")
    print("The volunteer joins with:")
    print(f"  CROWDTRAIN_JOIN_TOKEN={token} crowdtrain run --initial-peers <address>")
    return 0


def _eval(args: dict[str, Any]) -> int:
    from crowdtrain.cli.evaluate import evaluate, print_evaluation
    from crowdtrain.node.logs import setup_logging

    setup_logging("text", 0, quiet=True)
    evaluation = evaluate(
        args["run_file"],
        run_id=args["run_id"],
        checkpoint=args["checkpoint"],
        state_dir=args["state_dir"],
        num_stages=args["stages"],
        drop=args["drop"],
        sweep=args["sweep"],
        batches=args["batches"],
        batch_size=args["batch_size"],
        initial_peers=args["initial_peers"] or (),
        join_token=args["join_token"] or os.environ.get("CROWDTRAIN_JOIN_TOKEN", ""),
        data_cache_dir=args["data_cache_dir"] or os.environ.get("CROWDTRAIN_DATA_CACHE_DIR", ""),
    )
    print_evaluation(evaluation, args["json"])
    return 0


def _preset(args: dict[str, Any]) -> int:
    from crowdtrain.manifest import preset_run_file, preset_summaries

    if args["name"] is not None:
        print(preset_run_file(args["name"]), end="")
        return 0
    summaries = preset_summaries()
    width = max(map(len, summaries))
    for name, summary in summaries.items():
        print(f"{name:<{width}}  {summary}")
    print("Print one as a run file to start from: crowdtrain preset NAME > run.toml")
    return 0


def _tuples(args: dict[str, Any]) -> dict[str, Any]:
    return {name: tuple(value) if isinstance(value, list) else value for name, value in args.items()}

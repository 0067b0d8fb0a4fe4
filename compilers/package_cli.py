"""`tierkit keygen | inspect | verify | run`: the model package from the command line."""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any, cast

import numpy as np

from compilers import signing
from compilers.package import ModelPackage
from compilers.variants import VariantSet, is_variant_set
from runtimes.errors import ConfigError, InputError
from runtimes.session import SessionOptions


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("keygen", help="create an Ed25519 key pair for signing packages")
    p.add_argument("stem", help="writes STEM.key (private, mode 0600) and STEM.pub")
    p.set_defaults(func=_keygen)

    p = subparsers.add_parser("inspect", help="show a package's manifest or a variant set's index")
    p.add_argument("package", help="package directory, .tkpkg archive, or variant set directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_inspect)

    p = subparsers.add_parser("verify", help="check hashes and, with --trusted-key, the signature")
    p.add_argument("package")
    _add_trusted_key(p)
    p.set_defaults(func=_verify)

    p = subparsers.add_parser("run", help="run a package on inputs from an .npz file")
    p.add_argument("package")
    p.add_argument("--input", required=True, help=".npz with one array per model input name")
    p.add_argument("--output", help="write outputs to this .npz (default: print a summary)")
    _add_trusted_key(p)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = backend default)")
    p.set_defaults(func=_run)


class _OldKeySpelling(argparse.Action):
    """`--key`, the old spelling of `--trusted-key` (the name `tierkit serve` uses): still accepted, with a warning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        # FutureWarning: a deprecation meant for the person at the command line (shown by default)
        warnings.warn(f"{option_string} is deprecated; use --trusted-key", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), values])


def _add_trusted_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trusted-key", action="append", default=[], metavar="PUB", dest="trusted_key",
                   help="trusted public key (repeatable); with one, an unsigned or wrongly signed package is refused")
    p.add_argument("--key", action=_OldKeySpelling, dest="trusted_key", help=argparse.SUPPRESS)


def _keys(paths: list[str]) -> list[Any] | None:
    return [signing.load_public_key(p) for p in paths] if paths else None


def _open(path: str, keys: list[str]) -> ModelPackage:
    if is_variant_set(path):
        return VariantSet.load(path).open(trusted_keys=_keys(keys))
    return ModelPackage.open(path, trusted_keys=_keys(keys))


def _keygen(args: argparse.Namespace) -> int:
    priv, pub = signing.generate_keypair(args.stem)
    print(f"private key: {priv}\npublic key:  {pub}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if is_variant_set(args.package):
        vs = VariantSet.load(args.package)
        if args.json:
            print(json.dumps({"name": vs.name, "target": vs.target,
                              "variants": [e.__dict__ for e in vs.entries], "rejected": list(vs.rejected)}, indent=2))
            return 0
        print(f"variant set {vs.name!r} for {vs.target} ({len(vs)} variants, cheapest first)")
        for e in vs.entries:
            star = "*" if e.recommended else " "
            fid = ", ".join(f"{k}={v:.4g}" for k, v in e.fidelity.items() if isinstance(v, int | float))
            print(f" {star} {e.id:<24} {e.precision:<5} {e.runtime:<12} p50={e.cost_ms:.3f} ms "
                  f"size={e.size_bytes / 1024:.1f} KiB  {fid}")
        return 0
    pkg = ModelPackage.open(args.package)
    m = pkg.manifest
    if args.json:
        print(json.dumps(m.to_json(), indent=2, sort_keys=True))
        return 0
    print(f"{m.name} v{m.version}  target={m.target}  precision={m.precision}  runtime={m.runtime}  task={m.task}")
    for kind, specs in (("input", m.inputs), ("output", m.outputs)):
        for s in specs:
            print(f"  {kind:<6} {s.name}: {s.dtype}{list(s.shape)}")
    print(f"  passes: {', '.join(p.get('name', '?') for p in m.passes) or 'none'}")
    print(f"  fidelity: {json.dumps(m.fidelity)}")
    print(f"  latency (build host): {json.dumps(m.latency_ms)}")
    print(f"  size: {m.size_bytes} bytes in {len(m.files)} files; signed: "
          f"{'yes' if (pkg.directory / signing.SIGNATURE_FILE).exists() else 'no'}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    pkg = _open(args.package, args.trusted_key)
    how = f"signature by key {pkg.signed_by}" if pkg.signed_by else "hashes only (no --key given)"
    print(f"OK: {pkg.name} v{pkg.manifest.version} ({pkg.manifest.precision}), {len(pkg.manifest.files)} files; {how}")
    return 0


def _run(args: argparse.Namespace) -> int:
    pkg = _open(args.package, args.trusted_key)
    try:
        with np.load(args.input) as data:
            inputs = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        msg = f"cannot read inputs from {args.input!r}: {exc}; give an .npz with one array per input name"
        raise ConfigError(msg) from None
    wanted = {s.name for s in pkg.manifest.inputs}
    inputs.pop("labels", None)  # calibration/validation files may carry labels beside the inputs
    missing = wanted - set(inputs)
    if missing:
        msg = f"{args.input} lacks input(s) {sorted(missing)}; it has {sorted(inputs)}"
        raise InputError(msg)
    with pkg.open_session(SessionOptions(intra_op_threads=args.threads)) as session:
        outputs = session.run(inputs)
    if args.output:
        # Any: numpy's stub would match **outputs against its `allow_pickle: bool` keyword too
        np.savez(args.output, **cast("dict[str, Any]", outputs))
        print(f"wrote {', '.join(outputs)} to {args.output}")
    else:
        for name, value in outputs.items():
            print(f"{name}: {value.dtype}{list(value.shape)} min={value.min():.4g} max={value.max():.4g}")
    return 0


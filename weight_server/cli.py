"""`rlhf-weight-server`: the versioned parameter server process.

    rlhf-weight-server                                   # loopback, random ports (printed)
    rlhf-weight-server weight_server.port=5555 weight_server.pub_port=5556 weight_server.persist_dir=ckpt/weights
    rlhf-weight-server --gen-keys keys/                  # CURVE key pairs for weight_server=curve

Runs until SIGTERM/SIGINT. Prints one line with the two addresses once bound (and writes them
as JSON to ``weight_server.address_file`` when set) so a parent process can connect clients.
"""

from __future__ import annotations

import logging
import sys

from rlhf_core.cli import hydra_entry
from rlhf_core.config import to_object, validate


def run_server(cfg) -> int:
    from weight_server.server import WeightServer

    conf = to_object(cfg)
    validate(conf)
    logging.basicConfig(level=conf.run.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = WeightServer(conf.weight_server)
    shm = server.shm.path if server.shm is not None else "off"
    print(f"weight server listening on {server.address} (announcements on {server.pub_address}; shm {shm})", flush=True)
    server.serve_forever()
    logging.getLogger("weight_server").info("weight server stopped")
    return 0


_hydra_main = hydra_entry()(run_server)


def gen_keys(argv: list[str]) -> int:
    from weight_server.auth import generate_keys

    i = argv.index("--gen-keys")
    if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
        print("error: --gen-keys needs a directory: rlhf-weight-server --gen-keys DIR", file=sys.stderr)
        return 2
    paths = generate_keys(argv[i + 1])
    print(f"wrote CURVE key pairs to {argv[i + 1]}; use these overrides:")
    print("  server:  weight_server=curve " + " ".join(
        f"weight_server.{k}={paths[k]}" for k in ("curve_server_public", "curve_server_secret", "curve_client_public")))
    print("  clients: weight_server=curve " + " ".join(
        f"weight_server.{k}={paths[k]}" for k in ("curve_server_public", "curve_client_public", "curve_client_secret")))
    return 0


def main() -> None:
    if "--gen-keys" in sys.argv[1:]:  # a plain command, before Hydra parses the arguments
        sys.exit(gen_keys(sys.argv[1:]))
    _hydra_main()


main.config_name = _hydra_main.config_name  # type: ignore[attr-defined]  # read by the config tests


if __name__ == "__main__":
    main()

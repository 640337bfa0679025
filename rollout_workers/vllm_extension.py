"""What the `vllm` engine runs inside vLLM's worker process: :class:`WeightLoaderExtension`
(vLLM's ``worker_extension_cls``). Free of project imports, so that process imports it cheaply."""

from __future__ import annotations

import os

OWNER_POLL_S = 1.0  # how often vLLM's worker process checks that the rollout worker still lives


class WeightLoaderExtension:
    """Mixed into each vLLM worker; its methods run there, called through ``collective_rpc``."""

    def rlhf_watch_owner(self, owner_pid: int, folder: str) -> int:
        """Tie vLLM's processes to the rollout worker that started them: vLLM's engine core does not
        watch its parent, so a SIGKILLed worker would leave it and this process holding memory. A
        daemon thread stops both once the owner is gone, and removes the owner's private ``folder``
        (in ``/dev/shm``'s memory). Returns this process's pid."""
        import shutil
        import signal
        import threading
        import time

        import psutil

        owner = psutil.Process(owner_pid)
        born = owner.create_time()
        core = os.getppid() if os.getppid() != owner_pid else None  # None: this process is the engine core

        def owner_alive() -> bool:
            try:
                return owner.create_time() == born and owner.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False

        def watch() -> None:
            while owner_alive():
                time.sleep(OWNER_POLL_S)
            shutil.rmtree(folder, ignore_errors=True)
            if core is not None:
                try:
                    os.kill(core, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(1)

        threading.Thread(target=watch, name="rlhf-owner-watch", daemon=True).start()
        return os.getpid()

    def rlhf_reload_weights(self, path: str) -> int:
        """Load the safetensors file at ``path`` through the model runner's in-place reload."""
        from safetensors.torch import load_file

        weights = load_file(path)  # host tensors; the reload moves them to the model's device
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        return len(weights)

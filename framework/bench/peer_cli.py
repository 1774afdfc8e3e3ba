"""`batchyard bench peers setup|status [vllm] [llamacpp]`: install or list the peer engines;
`batchyard bench peers serve vllm|llamacpp --port N`: run one's HTTP server in the foreground for
`bench serving --backend vllm|llamacpp`."""

from __future__ import annotations

import json
import logging

from framework.bench import peers

logger = logging.getLogger(__name__)


def main(args) -> int:
    unknown = [name for name in args.peer if name not in peers.PEER_BACKENDS]
    if unknown:  # (for every action: `status vlm` listed both peers as if it had been understood)
        logger.error("unknown peer %s; choose from %s", ", ".join(unknown), ", ".join(peers.PEER_BACKENDS))
        return 2
    if args.action == "status":
        print(json.dumps(peers.status(), indent=2))
        return 0
    if args.action == "serve":
        return serve(args)
    for name in args.peer or peers.PEER_BACKENDS:
        try:
            if name == "vllm":
                print(f"vLLM CPU: {peers.setup_vllm()}")
            else:
                print(f"llama.cpp: {peers.setup_llamacpp(jobs=args.jobs)}")
        except (peers.PeerMissing, OSError) as exc:
            logger.error("%s: %s", name, exc)
            return 1
    print(json.dumps(peers.status(), indent=2))
    return 0


def serve(args) -> int:
    import os

    if len(args.peer) != 1 or args.peer[0] not in peers.PEER_BACKENDS:
        logger.error("serve takes one peer: vllm or llamacpp")
        return 2
    folder = None
    if args.peer[0] == "vllm":
        from framework.model.loader import resolve_model

        folder = resolve_model(args.model_path)
    try:
        cmd, env = peers.serve_command(args.peer[0], args.port, folder=folder, dtype=args.dtype,
                                       model=args.llamacpp_model, kv_cache_dtype=args.kv_cache_dtype,
                                       llamacpp_args=peers.peer_flags(args.llamacpp_args, "--llamacpp-args"))
    except (peers.PeerMissing, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    print(" ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)

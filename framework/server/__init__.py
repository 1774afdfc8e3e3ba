"""Server mode: HTTP + TokenizerManager (main process), a Scheduler process, a Detokenizer process.

    launch.py              `serve(settings)`: spawns the processes, runs uvicorn, supervises, shuts down
    ipc.py                 ipc:// addresses in a temp dir, ZMQ sockets, child-process set-up
    scheduler_process.py   the scheduler's event loop over ZMQ, the start-up handshake, the watchdog
    detokenizer.py         incremental detokenization (never a broken UTF-8 tail), stop-string trim
    tokenizer_manager.py   asyncio side: tokenize, send, route outputs and control replies
    protocol.py            native /generate request parsing and response formatting, API errors
    openai_api.py          /v1/completions, /v1/chat/completions, /v1/models
    http_server.py         the FastAPI app: routes, auth, body limit, error format
"""

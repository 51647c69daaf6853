"""The policy server, in parts (`python -m trainer.serve` is its command line and documents the
HTTP API; `trainer.serve` re-exports what other code imports).

  server       PolicyServer and ServerConfig: the engine behind Starlette under uvicorn, the
               shared front door (`envs.untrusted.door`: header/body/handshake deadlines, the
               connection cap), auth, bodies, /generate (token ids in, token ids out), /health,
               /v1/models, /v1/sessions, and what the OpenAI endpoints share
  chat         POST /v1/chat/completions (a PolicyServer mixin)
  completions  POST /v1/completions (a PolicyServer mixin)
  validate     request errors (OpenAI error objects) and the checks of every request field
  text         replies read back from sampled ids: stop strings, settled text, tool calls, SSE
  sessions     the bounded session log of exact ids and log-probs
"""

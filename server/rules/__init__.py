"""What both edges enforce, each defined once (the native build generates rules.h from here): refusal messages, request limits, token-guarded RPCs, status codes, connection policy."""

"""The one-process Python edge: its grpcio server, the inference service, the request codec and checks, tokens, TLS and drain."""

"""The HTTP layer: the server, the OpenAI request and response shapes, and token-to-text
conversion. (Not named ``http``, so it never shadows the standard library's.)"""

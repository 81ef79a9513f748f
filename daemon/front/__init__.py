"""The front door, ``vqpool serve``: one OpenAI-style endpoint for every configured model, each
model's ``vqpool-worker`` started on demand as a child process and unloaded when idle."""

"""Who is connected: peer authentication (ZAP), the connected process of a request, the guard
on open connections, and rate-limited logging of misbehaving peers."""

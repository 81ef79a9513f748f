"""vqpoold's process: start-up checks, the poll loop serving both sockets, the metrics exporter,
and the exit statuses."""

"""What a launcher needs to know about a run without importing torch: ``lock`` (one run per run
directory) and ``exits`` (exit statuses, and the record a preempted rank leaves for its launcher)."""

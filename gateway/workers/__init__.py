"""``serve --workers N``: data-plane processes on one port, one control-plane owner."""

"""Files that survive a crash: atomic writes, and checkpoint folders every rank stages before
one completion record makes them visible."""

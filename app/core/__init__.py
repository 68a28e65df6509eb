"""Infrastructure every layer uses: settings, the database, errors, secrets, child processes, time."""

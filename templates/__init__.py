"""Jinja2 templates of the portal pages; shipped inside the package as ``app.templates`` (setup.py)."""

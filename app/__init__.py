"""dedloc portal and coordinator."""

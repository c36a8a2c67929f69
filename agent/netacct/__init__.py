"""netacct."""

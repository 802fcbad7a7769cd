"""Trainable heads that sit on a frozen backbone (MRP; later the drafter and the TSPD controller)."""

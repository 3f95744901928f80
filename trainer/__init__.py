"""The GPT-2 trainer clusterctl ships (`python -m trainer`)."""
import time

STARTED = time.monotonic()  # this process's start, for the startup line rank 0 prints

"""The destination and its commit: what may be written where, one run per destination, staging,
durability, the rename into place, what killed runs leave behind, and the manifest that records it.
"""

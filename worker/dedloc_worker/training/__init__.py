"""How a worker trains: the loop, its progress records, the device, checkpoints, spot checks, outer rounds."""

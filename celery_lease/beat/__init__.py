"""What beat runs: reaper, sweeper, pruner, restart recovery, periodic leased jobs."""

"""The values every layer shares: errors, files read and written safely, conv specs, targets,
schedules, timing protocol. Imports nothing else of MACO."""

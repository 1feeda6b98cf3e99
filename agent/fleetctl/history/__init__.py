"""The control node's record of fleetctl's runs: the shapes (model), the SQLite store (store) and
the recording around each command (record). Data flows one way: commands -> record -> store ->
the front ends that read it (cli.history: `fleetctl history`; report.html: the HTML fleet report)."""

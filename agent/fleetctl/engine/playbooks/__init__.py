"""Playbooks and their application: `reader` (a playbook's files and YAML, read safely), `model`
(the schema: a Playbook, loaded and checked), `tasks/` (the task kinds, one module each, in one
table), `plan` (a playbook applied to one host's facts and findings: pure), `patches`
(`--export-patch`), `apply` (check mode, check-then-apply, rolling batches: the changes it
plans go through the change engine)."""

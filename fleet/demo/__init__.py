"""`fleet demo`: the shipped suite on an embedded fleet (`run`, `suite`), the policy's
evaluation through the inference gateway (`evaluation`), and the charts they and `fleet report`
write (`chart`)."""

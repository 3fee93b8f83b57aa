"""Training: the state born sharded (state), the jitted step (step, optimizer, guard), batches
(batch), start-up (setup, initial_weights), evaluation, the dry run and the loop."""

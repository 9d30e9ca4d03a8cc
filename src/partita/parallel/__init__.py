"""Ways to split a model beyond ZeRO. So far: named process topologies with their groups
(`partita.parallel.topology`) and DeepSpeed's pipeline instruction schedules
(`partita.parallel.pipe_schedule`); executing pipeline schedules is still to come."""

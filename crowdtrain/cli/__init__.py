"""The command line: `crowdtrain run|status|check`, its flags, exit codes and the rendering of reports.

main    argument parsing, the commands, signals and exit codes (the console script's entry point)
status  `crowdtrain status`: collect the run's records, summarise them, render a table or JSON, watch
check   `crowdtrain check`: the volunteer's pre-flight (device, throughput, links, reachability, plan)
runs    choosing the run `status` and `check` read when the swarm holds several

May import every other package: nothing imports `cli`.
"""

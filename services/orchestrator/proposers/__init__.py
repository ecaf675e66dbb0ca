"""Draft sources other than the drafter: n-gram copy and the tokens a constraint's grammar forces."""

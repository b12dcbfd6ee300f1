"""What a target's and a drafter's layers share."""

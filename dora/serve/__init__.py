"""The rollout side: instances and router, dispatcher, episode runner, weight store."""

from .cli.app import main

# guarded: a `spawn` child (dostune bench runs each method in one) imports the parent's __main__ module again
if __name__ == "__main__":
    main()

from forgepack.cli import main

if __name__ == "__main__":  # guarded: worker processes that import this module must not run the CLI
    main()
